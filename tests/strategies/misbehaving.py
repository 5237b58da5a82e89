"""Strategies that take the run down with them, for the sweep engines' tests.

``crash_process``: the factory kills its own OS process (as a segfault in a native library would).
``spin``: the factory never returns and never yields to the simulator (an infinite loop in native code).
"""

from __future__ import annotations

import os
import signal
from typing import Any


def crash_process(group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
    os.kill(os.getpid(), signal.SIGKILL)


def spin(group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
    while True:
        pass
