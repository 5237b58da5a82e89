"""``shared-agent`` variants whose runs would differ between processes if the simulator let them: what they do
must reach the history the same way every time.

``finalizer_raises``: a ``weakref.finalize`` on each communicator whose callback raises (its repr holds an address).
``crash_with_repr``: PREPARE raises with the previous communicator's repr in the message.
``jitter``: ``execute`` sleeps a ``random.uniform`` time and reads ``time.monotonic_ns`` (backoff jitter).
"""

from __future__ import annotations

import random
import time
import weakref
from typing import Any

from sim.eplb.communicators.shared_agent import SharedAgentNixlCommunicator


def _fail() -> None:
    raise RuntimeError("finalizer failed")


def finalizer_raises(group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
    comm = SharedAgentNixlCommunicator(group, expert_weights, expert_buffer, prev_communicator)
    weakref.finalize(comm, _fail)
    return comm


def crash_with_repr(group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
    if prev_communicator is not None:
        raise RuntimeError(f"cannot reuse {prev_communicator!r} ({object()!r})")
    return SharedAgentNixlCommunicator(group, expert_weights, expert_buffer, prev_communicator)


class _Jittery(SharedAgentNixlCommunicator):
    def execute(self) -> None:
        started = time.monotonic_ns()
        time.sleep(random.uniform(0.0, 1e-3))
        assert time.monotonic_ns() >= started
        super().execute()


def jitter(group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
    return _Jittery(group, expert_weights, expert_buffer, prev_communicator)
