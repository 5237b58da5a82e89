"""Stand-ins for the vLLM modules that vLLM's EPLB files import and that cannot be imported outside a GPU deployment.

Each entry replaces one module of vLLM with the few names the code under test uses from it, behaving as vLLM's do
in a one-stage (no pipeline parallelism) deployment.  Everything else under ``vllm`` is vLLM's own file, run as it
is.  Why each one is stood in for:

- ``vllm``, ``vllm.distributed``, ``vllm.utils``, ``vllm.distributed.device_communicators``: their ``__init__``
  imports the whole engine (CUDA kernels, model registry); only the packages' folders are needed.
- ``vllm.logger``: imports ``vllm.envs`` and vLLM's logging configuration; here a plain :mod:`logging` logger
  with vLLM's ``*_once`` methods.
- ``vllm.platforms``: detects the GPU platform at import; here the platform of the world the rank runs in
  (``cuda``, or ``rocm`` under the ``rocm-strict`` profile), as :func:`set_platform` says.
- ``vllm.config``: the engine's configuration classes (pydantic models of the whole engine); only a name is used.
- ``vllm.distributed.parallel_state``: vLLM's global process groups, which need ``init_distributed_environment``;
  here a :class:`GroupCoordinator` around the group epsim hands the strategy, and one pipeline stage.
- ``vllm.distributed.stateless_coordinator``: the elastic-EP coordinator over a TCP store; only its class is
  used (``isinstance``).
- ``vllm.distributed.device_communicators.pynccl``/``pynccl_wrapper``: load ``libnccl``; NCCL is not modelled.
- ``vllm.distributed.utils``: imports torch's TCPStore rendezvous and ``vllm.envs``; ``is_weak_contiguous`` here.
- ``vllm.utils.gpu_sync_debug``: a debugging aid that flags GPU synchronisations; here it allows them.
- ``vllm.utils.torch_utils``: imports custom-op registration; ``PIN_MEMORY`` is False, as on a host without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch

# A stand-in module being filled in: its attributes are the ones vLLM's module has, set here by name.
Module = Any

PACKAGES = ("vllm", "vllm.distributed", "vllm.utils", "vllm.distributed.device_communicators")


class _OnceLogger(logging.LoggerAdapter):
    """vLLM's logger: a logger with ``info_once``/``warning_once``/``debug_once`` (each message once)."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})
        self._said: set[tuple[int, str]] = set()

    def _once(self, level: int, msg: str, *args: Any, **_scope: Any) -> None:
        key = (level, str(msg))
        if key not in self._said:
            self._said.add(key)
            self.log(level, msg, *args)

    def info_once(self, msg: str, *args: Any, **kw: Any) -> None:
        self._once(logging.INFO, msg, *args, **kw)

    def warning_once(self, msg: str, *args: Any, **kw: Any) -> None:
        self._once(logging.WARNING, msg, *args, **kw)

    def debug_once(self, msg: str, *args: Any, **kw: Any) -> None:
        self._once(logging.DEBUG, msg, *args, **kw)


def _logger(m: Module, world: "World") -> None:
    # vLLM configures a handler of its own for its "vllm" logger; here its messages are not epsim's output, so they
    # go nowhere unless the user gave that logger a handler.
    root = logging.getLogger("vllm")
    if not root.handlers:
        root.addHandler(logging.NullHandler())
        root.propagate = False
    m.init_logger = lambda name: _OnceLogger(logging.getLogger(name))


class _Platform:
    """``current_platform``: the answers vLLM's EPLB code asks for, from the rank's world."""

    def __init__(self, world: "World") -> None:
        self._world = world

    @property
    def device_type(self) -> str:
        return "cuda"

    def is_rocm(self) -> bool:
        return self._world.platform == "rocm"

    def is_cuda(self) -> bool:
        return self._world.platform == "cuda"

    def is_cuda_alike(self) -> bool:
        return True

    def is_cpu(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False


def _platforms(m: Module, world: "World") -> None:
    m.current_platform = _Platform(world)


def _config(m: Module, world: "World") -> None:
    class ParallelConfig:  # only named in a signature by the code under test
        pass

    m.ParallelConfig = ParallelConfig


class _Stage:
    world_size = 1
    rank_in_group = 0


def _parallel_state(m: Module, world: "World") -> None:
    class GroupCoordinator:
        """vLLM's group coordinator around one process group: ``cpu_group`` (the group epsim hands the strategy,
        gloo or epsim's fake), ``device_group`` (the same group: NCCL is not modelled) and no device
        communicator."""

        def __init__(self, group: Any, unique_name: str = "ep") -> None:
            self.cpu_group = group
            self.device_group = group
            self.device_communicator = None
            self.unique_name = unique_name
            self.rank_in_group = group.rank()
            self.world_size = group.size()
            self.ranks = list(range(self.world_size))

    m.GroupCoordinator = GroupCoordinator
    m.get_pp_group = lambda: _Stage()
    m.is_local_first_rank = lambda: False  # only decides whether vLLM logs its "initialized" line


def _stateless(m: Module, world: "World") -> None:
    import importlib

    parallel_state: Any = importlib.import_module("vllm.distributed.parallel_state")  # this process's, while loading

    class StatelessGroupCoordinator(parallel_state.GroupCoordinator):
        """The coordinator of an elastic-EP group (standby groups made at a reconfiguration)."""

    m.StatelessGroupCoordinator = StatelessGroupCoordinator


def _pynccl(m: Module, world: "World") -> None:
    class PyNcclCommunicator:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("NCCL is not modelled by epsim; use the 'nixl' EPLB communicator")

    m.PyNcclCommunicator = PyNcclCommunicator


def _pynccl_wrapper(m: Module, world: "World") -> None:
    class ncclDataTypeEnum:  # noqa: N801 - vLLM's name
        @staticmethod
        def supports_torch_dtype(dtype: Any) -> bool:
            return False

    m.ncclDataTypeEnum = ncclDataTypeEnum


def is_weak_contiguous(t: torch.Tensor) -> bool:
    """Contiguous, or its elements fill its storage from its offset to the end without gaps."""
    if t.is_contiguous():
        return True
    return t.untyped_storage().nbytes() - t.storage_offset() * t.element_size() == t.numel() * t.element_size()


def _dist_utils(m: Module, world: "World") -> None:
    m.is_weak_contiguous = is_weak_contiguous


def _gpu_sync_debug(m: Module, world: "World") -> None:
    m.gpu_sync_allowed = contextlib.nullcontext


def _torch_utils(m: Module, world: "World") -> None:
    m.PIN_MEMORY = False


class World:
    """What the stand-ins of one process answer from: the platform its ranks run on."""

    def __init__(self) -> None:
        self.platform = "cuda"


STANDINS: dict[str, Callable[[Module, World], None]] = {
    "vllm.logger": _logger,
    "vllm.platforms": _platforms,
    "vllm.config": _config,
    "vllm.distributed.parallel_state": _parallel_state,
    "vllm.distributed.stateless_coordinator": _stateless,
    "vllm.distributed.device_communicators.pynccl": _pynccl,
    "vllm.distributed.device_communicators.pynccl_wrapper": _pynccl_wrapper,
    "vllm.distributed.utils": _dist_utils,
    "vllm.utils.gpu_sync_debug": _gpu_sync_debug,
    "vllm.utils.torch_utils": _torch_utils,
}
