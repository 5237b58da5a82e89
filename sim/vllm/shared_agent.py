"""``--strategy vllm+shared-agent[:PATH]``: vLLM's ``NixlEplbCommunicator`` with the change under review applied, as
epsim's own subclass of vLLM's class (vLLM's file stays as released):

- the factory passes the previous communicator on, and a communicator built from one uses that communicator's
  ``NixlWrapper`` (the same NIXL agent) instead of creating one;
- it registers memory only when it creates a fresh agent (expert weights and ``expert_buffer`` keep their storage,
  so the shared agent's registrations stay valid);
- it loads every peer's metadata as vLLM 0.33.0 does (re-adding a known peer is idempotent in NIXL), with no cache
  of remote names;
- its ``__del__`` only releases transfer handles: Python's reference counting decides when the agent dies, and
  NIXL deregisters and disconnects in the agent's destructor.

So the matrix can put vLLM 0.33.0 and the same code plus this change side by side.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .strategy import BACKEND, COMMUNICATOR_MODULE, VllmProcess


class SharedAgentProcess(VllmProcess):
    def __init__(self, path: str | None, name: str) -> None:
        super().__init__(path, name)
        self.cls = _subclass(
            self.vllm[COMMUNICATOR_MODULE].NixlEplbCommunicator, self.vllm["vllm.distributed.nixl_utils"]
        )

    def create(self, group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
        """vLLM's ``create_eplb_communicator`` for ``nixl`` (its checks first), building the subclass with the
        previous communicator."""
        weights, buffer = self.views(group, expert_weights, expert_buffer)
        self.bind_nixl(expert_weights)
        module = self.vllm[COMMUNICATOR_MODULE]
        cls, base = self.cls, module.NixlEplbCommunicator
        # The factory builds the class its module names: the subclass, for the length of the call (this process's
        # own module instance; no other thread of it builds a communicator meanwhile).
        module.NixlEplbCommunicator = lambda **kw: cls(**kw, prev_communicator=prev_communicator)
        try:
            return module.create_eplb_communicator(
                self.coordinator(group, stateless=prev_communicator is not None), BACKEND, weights, buffer
            )
        finally:
            module.NixlEplbCommunicator = base


def configure(path: str | None, name: str):
    return SharedAgentProcess(path, name).create


def _subclass(base: type, nixl_utils: Any) -> type:
    class SharedAgentNixlEplbCommunicator(base):
        def __init__(
            self, cpu_group: Any, all_expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None
        ) -> None:
            shared = getattr(prev_communicator, "_nixl_wrapper", None)
            self._fresh_agent = shared is None
            if shared is None:
                super().__init__(cpu_group, all_expert_weights, expert_buffer)
                return
            # vLLM's constructor makes its agent from nixl_utils.NixlWrapper: for the length of the call, that
            # name gives the previous communicator's agent.
            cls = nixl_utils.NixlWrapper
            nixl_utils.NixlWrapper = lambda name, config=None: shared
            try:
                super().__init__(cpu_group, all_expert_weights, expert_buffer)
            finally:
                nixl_utils.NixlWrapper = cls

        def _init_registered_buffers(self) -> None:
            if self._fresh_agent:
                super()._init_registered_buffers()

        def __del__(self) -> None:
            wrapper: Any = getattr(self, "_nixl_wrapper", None)
            for local_h, remote_h, xfer_h in getattr(self, "_xfer_entries", ()):
                with contextlib.suppress(Exception):
                    wrapper.release_xfer_handle(xfer_h)
                with contextlib.suppress(Exception):
                    wrapper.release_dlist_handle(local_h)
                with contextlib.suppress(Exception):
                    wrapper.release_dlist_handle(remote_h)

    return SharedAgentNixlEplbCommunicator
