"""A deliberately broken ``shared-agent``: its ``__del__`` also deregisters the shared agent's registrations.

This is the mistake of putting vLLM 0.33's cleanup back on top of the simplification: the new communicator
inherits ``nixl_wrapper`` and ``_registered_descs`` from the one it replaces, so when the old communicator is
finalized it deregisters memory that the new one (and every peer's READs) still rely on.  Load it as
``tests.strategies.broken_shared_agent:create``; the simulation must catch it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

from sim.eplb.communicators.shared_agent import SharedAgentNixlCommunicator


class BrokenSharedAgentCommunicator(SharedAgentNixlCommunicator):
    def __del__(self) -> None:
        super().__del__()
        agent = getattr(self, "nixl_wrapper", None)
        if agent is not None and self._registered_descs is not None:
            with contextlib.suppress(Exception):
                agent.deregister_memory(self._registered_descs)


def create(
    group: Any, expert_weights: Sequence[Sequence[Any]], expert_buffer: Sequence[Any], prev_communicator: Any = None
) -> BrokenSharedAgentCommunicator:
    return BrokenSharedAgentCommunicator(group, expert_weights, expert_buffer, prev_communicator)
