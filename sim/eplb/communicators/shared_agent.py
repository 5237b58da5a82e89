"""``shared-agent``: the simplification of vLLM PR #63134, read literally.

Code under test: written against ``nixl._api`` and ``torch.distributed`` only, so it runs unchanged on the fakes
and on real NIXL.

The description it implements: "Replace the per-arena agent registry with passing the previous communicator's
NixlWrapper to the new one.  Expert weights and expert_buffer keep their storage across reconfigurations, so the
shared agent's registrations stay valid; Python refcounting decides when the agent dies and NIXL
deregisters/disconnects in its destructor.  Re-adding a known peer's metadata is idempotent in NIXL, so no
remote-agent cache is needed either. [...] It registers memory only when it creates a fresh agent. [...] ``__del__``
only releases transfer handles."

So: ``create(..., prev_communicator=old)`` takes ``old.nixl_wrapper`` (and the descriptors it was registered with)
and registers nothing; without a previous communicator it makes a fresh agent and registers every layer's expert
weights plus ``expert_buffer``.  Nothing checks that the new tensors are the ones the shared agent registered.
Remote setup calls ``add_remote_agent`` for every peer every time.  ``__del__`` releases transfer handles only:
the agent lives as long as some communicator (or handle) refers to it, and peers are never removed explicitly.

Data path as in vLLM 0.33 (receiver-initiated READs, remote setup deferred to the first ``set_transfer_context``),
shared with the other strategies in :mod:`sim.eplb.communicators.nixl_read`.
"""

from __future__ import annotations

import uuid
from typing import Any, Sequence

from sim.eplb.communicators.nixl_read import NixlReadCommunicator


class SharedAgentNixlCommunicator(NixlReadCommunicator):
    """A communicator on an agent it made, or on the agent of the communicator it replaces."""

    def __init__(
        self,
        group: Any,
        expert_weights: Sequence[Sequence[Any]],
        expert_buffer: Sequence[Any],
        prev_communicator: SharedAgentNixlCommunicator | None = None,
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        super().__init__(group, expert_weights, expert_buffer)
        tensors = self._tensors()
        self._registered_descs: Any = None  # what the shared agent registered (bookkeeping; never deregistered here)

        if prev_communicator is not None:
            self.nixl_wrapper = prev_communicator.nixl_wrapper
            self._registered_descs = prev_communicator._registered_descs
            return
        name = f"eplb-{self._rank}-{uuid.uuid4().hex[:8]}"
        self.nixl_wrapper = nixl_agent(name, nixl_agent_config(capture_telemetry=False))
        descs = self.nixl_wrapper.get_reg_descs(tensors, self._mem)
        self.nixl_wrapper.register_memory(descs)
        self._registered_descs = descs

    def __del__(self) -> None:
        if getattr(self, "nixl_wrapper", None) is None:
            return
        self._xfer_handles = []
        self._release_handles(quiet=True)


def create(
    group: Any, expert_weights: Sequence[Sequence[Any]], expert_buffer: Sequence[Any], prev_communicator: Any = None
) -> SharedAgentNixlCommunicator:  # one of these, when given
    return SharedAgentNixlCommunicator(group, expert_weights, expert_buffer, prev_communicator)
