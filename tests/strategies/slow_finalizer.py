"""``per-communicator-agent`` whose ``__del__`` takes a while after it has released everything, before its agent can
go: a finalizer that blocks (a NIXL call waiting on its progress thread, a loaded machine).  Not a bug of the
strategy; a GC fault that runs it on another thread must not make the run's exit see a half-finalized communicator
as a leak."""

from __future__ import annotations

import select
from typing import Any

from sim.eplb.communicators.per_agent import PerAgentNixlCommunicator

FINALIZER_S = 0.5


class _SlowFinalizer(PerAgentNixlCommunicator):
    def __del__(self) -> None:
        super().__del__()
        # Wall time only: select is not one of the calls the simulation makes take simulated time, so a simulated
        # run is unchanged (time.sleep there would be half a simulated second, still running when the run ends).
        select.select([], [], [], FINALIZER_S)


def create(group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
    return _SlowFinalizer(group, expert_weights, expert_buffer)
