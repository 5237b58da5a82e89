"""``--strategy vllm[:PATH]``: vLLM's ``NixlEplbCommunicator``, built by vLLM's own ``create_eplb_communicator``
with the arguments vLLM's ``EplbState.create_communicator`` passes: a group coordinator, the ``"nixl"`` backend,
the model's ``expert_weights`` (every MoE layer's tensors) and the ``expert_buffer``, the same list objects every
time.  vLLM 0.33.0's factory takes no previous communicator; the one epsim hands over is dropped, as vLLM drops it.

Every load of the strategy (one per simulated process) makes a :class:`VllmProcess` with its own instance of
vLLM's modules.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from sim.errors import UnknownStrategy

from . import device, loader, source

COMMUNICATOR_MODULE = "vllm.distributed.eplb.eplb_communicator"
BACKEND = "nixl"  # ParallelConfig.eplb_config.communicator


class VllmProcess:
    """One process's vLLM: its own instance of vLLM's modules, the device views of its tensors, and how vLLM's
    ``NixlWrapper`` is bound there.  Every load of the strategy (every simulated process) makes one."""

    def __init__(self, path: str | None, name: str) -> None:
        from .move_loop import REBALANCE_MODULE

        where = source.locate(path)
        # vLLM's move loop comes from the same sources, in the same instance of its modules; a branch whose
        # rebalance_execute does not load here still has its communicator run, under epsim's model of the loop
        # (``move_loop_error`` says why, and the run's metrics say which loop moved the experts).
        self.move_loop_error: str | None = None
        try:
            try:
                self.vllm = loader.load(where, COMMUNICATOR_MODULE, REBALANCE_MODULE)
            except UnknownStrategy:
                raise
            except (Exception, SystemExit) as exc:  # noqa: BLE001
                self.vllm = loader.load(where, COMMUNICATOR_MODULE)
                self.move_loop_error = f"{REBALANCE_MODULE} does not load here: {type(exc).__name__}: {exc}"
        except UnknownStrategy:
            raise
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a vLLM branch that does not import here
            raise UnknownStrategy(
                f"strategy {name!r}: vLLM's {COMMUNICATOR_MODULE} from {where.origin} does not "
                f"load here: {type(exc).__name__}: {exc}"
            ) from exc
        if not hasattr(self.vllm[COMMUNICATOR_MODULE], "create_eplb_communicator"):
            raise UnknownStrategy(
                f"strategy {name!r}: {where.origin} has no create_eplb_communicator in {COMMUNICATOR_MODULE}"
            )
        self._views: device.ViewCache | None = None
        self._bound = False

    def move_loop(self):
        """vLLM's ``rebalance_execute`` for this process (None where it did not load), reporting the device the
        communicator's views report."""
        from .move_loop import REBALANCE_MODULE, VllmMoveLoop

        if self.move_loop_error is not None:
            return None
        device = self._views.device if self._views is not None else torch.device("cuda", 0)
        return VllmMoveLoop(self.vllm[REBALANCE_MODULE], device)

    def coordinator(self, group: Any, stateless: bool) -> Any:
        """vLLM's coordinator of the EPLB group: a stateless one for groups made at an elastic reconfiguration."""
        name = "vllm.distributed.stateless_coordinator" if stateless else "vllm.distributed.parallel_state"
        cls = "StatelessGroupCoordinator" if stateless else "GroupCoordinator"
        return getattr(self.vllm[name], cls)(group)

    def views(self, group: Any, expert_weights: Any, expert_buffer: Any) -> tuple[list, list]:
        """The weights and buffer as the code under test sees them: on this process's GPU (``cuda:<rank at
        start>``)."""
        if self._views is None:
            self._views = device.ViewCache(torch.device("cuda", group.rank() % 8))
        return self._views.views(expert_weights), self._views.views(expert_buffer)

    def bind_nixl(self, expert_weights: Any) -> None:
        """Once, before vLLM first asks for NIXL: the platform the stand-ins report, and where the world's memory is
        host memory, vLLM's ``NixlWrapper`` bound to the NIXL it would import, wrapped by
        :func:`sim.vllm.device.host_memory_agent`.  Elsewhere vLLM's ``nixl_utils`` binds it itself, on first
        use."""
        if self._bound:
            return
        self._bound = True
        fake = _fake_profile()
        if fake is not None:
            self.vllm.world.platform = "rocm" if fake.name == "rocm-strict" else "cuda"
            takes_device_memory = fake.vram_ok
        else:
            self.vllm.world.platform = "rocm" if getattr(torch.version, "hip", None) else "cuda"
            takes_device_memory = torch.Tensor.device.__get__(expert_weights[0][0]).type != "cpu"
        if takes_device_memory:
            return
        nixl_utils = self.vllm["vllm.distributed.nixl_utils"]
        package = "nixl_rocm" if self.vllm.world.platform == "rocm" else "nixl"
        try:
            api = importlib.import_module(f"{package}._api")
        except ImportError:
            return  # vLLM finds no NIXL either, and says so
        nixl_utils.NixlWrapper = device.host_memory_agent(api.nixl_agent)
        nixl_utils.nixl_agent_config = getattr(api, "nixl_agent_config", None)

    def create(self, group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
        weights, buffer = self.views(group, expert_weights, expert_buffer)
        self.bind_nixl(expert_weights)
        factory = self.vllm[COMMUNICATOR_MODULE].create_eplb_communicator
        return factory(self.coordinator(group, stateless=prev_communicator is not None), BACKEND, weights, buffer)


def configure(path: str | None, name: str):
    """The factory for one process (a bad source is a one-line UnknownStrategy)."""
    return VllmProcess(path, name).create


def _fake_profile():
    """The fake NIXL's profile if ``nixl._api`` is the fake now, else None."""
    import sys

    import fakes.install

    api = sys.modules.get("nixl._api")
    if api is None or not fakes.install.is_fake(api):
        return None
    from fakes.nixl._fabric import current_fabric

    return current_fabric().profile
