"""``per-communicator-agent``: the NIXL EPLB communicator of vLLM 0.33 as released (elastic mode).

Code under test: written against ``nixl._api`` and ``torch.distributed`` only, so it runs unchanged on the fakes
and on real NIXL.

Lifecycle: every communicator makes its own NIXL agent under a fresh name and registers every layer's expert
weights plus ``expert_buffer`` with it.  ``prev_communicator`` is ignored, so during an elastic reconfiguration the
prepared communicator registers the same pages a second time while the old one is still alive.  ``__del__`` (which
never raises) releases transfer handles, deregisters what this communicator registered and forgets every peer.

Data path: receiver-initiated READs.  Remote setup (agent metadata, then per-(layer, tensor) base addresses and
strides, two ``all_gather_object`` on the group) runs in the constructor, as in 0.33.0's
``NixlEplbCommunicator``: so PREPARE is a collective of the new group, and a prepared communicator already holds
every new peer's agent.  (The other strategies model later revisions, which defer it to the first
``set_transfer_context``.)  The data path is shared with them in :mod:`sim.eplb.communicators.nixl_read`.

This model agrees with vLLM 0.33.0's own code (``--strategy vllm``) on every cell of the strategy matrix
(``tests/slow/test_matrix.py`` checks it).  ``per-communicator-agent-deferred`` (:func:`create_deferred`) is the
same lifecycle with the later revision's deferred remote setup.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Sequence

from sim.eplb.communicators.base import EplbCommunicator
from sim.eplb.communicators.nixl_read import NixlReadCommunicator


class PerAgentNixlCommunicator(NixlReadCommunicator):
    """One NIXL agent per communicator; the agent's lifetime is the communicator's."""

    eager_remote_setup = True  # False: a later revision's deferral to the first set_transfer_context

    def __init__(self, group: Any, expert_weights: Sequence[Sequence[Any]], expert_buffer: Sequence[Any]) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        super().__init__(group, expert_weights, expert_buffer)
        tensors = self._tensors()
        self._registered_descs: Any = None

        name = f"eplb-{self._rank}-{uuid.uuid4().hex[:8]}"
        self.nixl_wrapper = nixl_agent(name, nixl_agent_config(capture_telemetry=False))
        descs = self.nixl_wrapper.get_reg_descs(tensors, self._mem)
        self.nixl_wrapper.register_memory(descs)
        self._registered_descs = descs
        # As 0.33.0: every peer's agent and send metadata are loaded here, two collectives on the group, so a
        # prepared communicator holds the agents of the new group's ranks from PREPARE on.
        if self.eager_remote_setup:
            self._init_remote_state()

    def __del__(self) -> None:
        agent = getattr(self, "nixl_wrapper", None)
        if agent is None:
            return
        self._xfer_handles = []
        self._release_handles(quiet=True)
        if self._registered_descs is not None:
            with contextlib.suppress(Exception):
                agent.deregister_memory(self._registered_descs)
        for rank in sorted(self._remote_agents):
            if rank != self._rank:
                with contextlib.suppress(Exception):
                    agent.remove_remote_agent(self._remote_agents[rank])


class DeferredPerAgentNixlCommunicator(PerAgentNixlCommunicator):
    eager_remote_setup = False


def create(
    group: Any,
    expert_weights: Sequence[Sequence[Any]],
    expert_buffer: Sequence[Any],
    prev_communicator: EplbCommunicator | None = None,
) -> PerAgentNixlCommunicator:
    """vLLM 0.33 has no ``prev_communicator``: it is accepted and ignored."""
    return PerAgentNixlCommunicator(group, expert_weights, expert_buffer)


def create_deferred(
    group: Any,
    expert_weights: Sequence[Sequence[Any]],
    expert_buffer: Sequence[Any],
    prev_communicator: EplbCommunicator | None = None,
) -> PerAgentNixlCommunicator:
    """``per-communicator-agent-deferred``: the same lifecycle with remote setup deferred to the first
    ``set_transfer_context``, as a later vLLM revision does for stateless groups (PREPARE then makes no collective
    of the new group).  The DeepEP dimension of the matrix runs on it, so that only the buffers' order decides
    its cells."""
    return DeferredPerAgentNixlCommunicator(group, expert_weights, expert_buffer)
