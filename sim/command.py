"""What the engine posts to a worker, in either world: the simulated worker (``sim/worker.py``) and a real rank
(``real_backends/cluster.py`` takes its kind and arguments to the rank over its socket).  Its own module so that the
engine, which both worlds share, does not import the simulated worker (and torch) with it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Command:
    kind: str
    args: dict[str, Any] = field(default_factory=dict)
    done: Any = None  # simpy event the worker succeeds when the command is complete
