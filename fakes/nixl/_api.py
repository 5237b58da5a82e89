"""Drop-in for ``nixl._api`` of NIXL 1.5.1: ``nixl_agent``, ``nixl_agent_config`` and the handle wrappers.

Signatures, defaults, return types and the way bad input surfaces (a ``None`` descriptor list turning into a
``TypeError`` one call later, ``KeyError`` for an unknown operation) follow the real module.  Everything with state
is in the fake bindings (``_bindings.nixlAgent``) and its fabric, so this module stays a thin translation layer,
as the real one is.
"""

from __future__ import annotations

import enum
import logging
import pickle
import sys
from typing import Any, Optional, Union

import numpy as np

from . import _bindings as nixlBind
from .logging import get_logger  # noqa: F401 - the real module imports it too; the fake logs elsewhere (logger below)

logger = logging.getLogger("epsim.fakes.nixl")

DEFAULT_COMM_PORT = nixlBind.DEFAULT_COMM_PORT
nixl_backend_handle = int


def _torch_tensor(obj: object) -> bool:
    # Only consult torch if the caller already imported it: the fake, like the real module, never imports torch.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _tensor_class() -> type | None:
    """``torch.Tensor`` if the caller has imported torch (exact-type checks on the transfer path), else None."""
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None)


class _Handle:
    __slots__ = ("_handle", "_agent", "_released")
    _release_call = ""

    def __init__(self, agent: nixlBind.nixlAgent, value: int) -> None:
        self._handle = int(value)
        self._agent = agent  # holding the core keeps the agent alive while the handle lives (fact 27)
        self._released = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(0x{self._handle:x}, released={self._released})"

    # Equality stays identity, as in 1.5.1.  The hash comes from the handle's value (a fabric counter), not id():
    # vLLM waits on a set of handles, and the set's order (so a simulation's event order) must not depend on where
    # the objects lie in memory.  The tuple spreads the values' zero low bits.
    def __hash__(self) -> int:
        return hash((self._handle,))

    def release(self) -> None:
        if not self._released:
            getattr(self._agent, self._release_call)(self._handle)
            self._released = True

    def __del__(self) -> None:
        if self._released:
            return
        try:
            getattr(self._agent, self._release_call)(self._handle)
        except Exception:
            try:
                logger.error("%s finalization failed for 0x%x", type(self).__name__, self._handle)
            except Exception:
                pass


class nixl_prepped_dlist_handle(_Handle):
    __slots__ = ()
    _release_call = "releasedDlistH"


class nixl_xfer_handle(_Handle):
    __slots__ = ()
    _release_call = "releaseXferReq"


class nixl_thread_sync_t(enum.Enum):
    NIXL_THREAD_SYNC_NONE = nixlBind.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = nixlBind.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = nixlBind.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = nixlBind.NIXL_THREAD_SYNC_DEFAULT


class nixl_agent_config:
    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list[str] = ["UCX"],  # noqa: B006 - the real default, shared the same way
        sync_mode: Optional[nixl_thread_sync_t] = None,
    ) -> None:
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.backends = backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


_MEMS = {
    "DRAM": nixlBind.DRAM_SEG,
    "VRAM": nixlBind.VRAM_SEG,
    "FILE": nixlBind.FILE_SEG,
    "BLOCK": nixlBind.BLK_SEG,
    "OBJ": nixlBind.OBJ_SEG,
    "cpu": nixlBind.DRAM_SEG,
    "cuda": nixlBind.VRAM_SEG,
}
_OPS = {"READ": nixlBind.NIXL_READ, "WRITE": nixlBind.NIXL_WRITE}
_STATES = {nixlBind.NIXL_SUCCESS: "DONE", nixlBind.NIXL_IN_PROG: "PROC"}  # any other status reads "ERR"


class nixl_agent:
    def __init__(
        self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None, instantiate_all: bool = False
    ) -> None:
        if nixl_conf is not None and instantiate_all:
            logger.warning("Ignoring instantiate_all based on the provided config in agent creation.")
            instantiate_all = False
        conf = nixl_conf or nixl_agent_config()
        sync = conf.sync_mode or (
            nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            if conf.enable_listen
            else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        )
        core_conf = nixlBind.nixlAgentConfig(
            useProgThread=conf.enable_pthread,
            useListenThread=conf.enable_listen,
            listenPort=conf.port,
            syncMode=int(sync.value),
            captureTelemetry=conf.capture_telemetry,
        )
        self.agent = nixlBind.nixlAgent(agent_name, core_conf)
        self.agent.wrappers.add(self)  # so that a restart fault can hand this object the new agent
        self.name = agent_name
        self._leaked_xfer_handles: list[int] = []
        self.notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, int] = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self.plugin_list = self.agent.getAvailPlugins()
        self.plugin_b_options: dict[str, dict[str, str]] = {}
        self.plugin_mem_types: dict[str, list[str]] = {}
        wanted = self.plugin_list if instantiate_all else conf.backends
        for backend in wanted:
            if backend not in self.plugin_list:
                logger.warning("Skipping backend registration %s due to the missing plugin.", backend)
                continue
            params = {"num_threads": str(conf.num_threads)} if conf.num_threads > 0 else {}
            self.create_backend(backend, params)
        self.nixl_mems = dict(_MEMS)
        self.nixl_ops = dict(_OPS)

    # -- plugins and backends -----------------------------------------------------------------------------
    def get_plugin_list(self) -> list[str]:
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        if backend not in self.plugin_mem_types and backend in self.plugin_list:
            self.plugin_b_options[backend], self.plugin_mem_types[backend] = self.agent.getPluginParams(backend)
        return self.plugin_mem_types.get(backend, [])

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        self.get_plugin_mem_types(backend)
        return self.plugin_b_options.get(backend, {})

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return self.backend_mems.get(backend, [])

    def get_backend_params(self, backend: str) -> dict[str, str]:
        return self.backend_options.get(backend, {})

    def create_backend(self, backend: str, initParams: dict[str, str] = {}) -> None:  # noqa: B006
        handle = self.agent.createBackend(backend, initParams)
        self.backends[backend] = handle
        self.backend_options[backend], self.backend_mems[backend] = self.agent.getBackendParams(handle)

    def _handles(self, backends: list[str]) -> list[int]:
        return [self.backends[b] for b in backends] if backends else []

    # -- memory ---------------------------------------------------------------------------------------------
    def register_memory(self, reg_list: Any, mem_type: Optional[str] = None, backends: list[str] = []):  # noqa: B006
        descs = self.get_reg_descs(reg_list, mem_type)
        self.agent.registerMem(descs, self._handles(backends))
        return descs

    def deregister_memory(self, dereg_list: Any, backends: list[str] = []) -> None:  # noqa: B006
        self.agent.deregisterMem(dereg_list, self._handles(backends))

    def query_memory(self, reg_list: Any, backend: str, mem_type: Optional[str] = None) -> list:
        descs = self.get_reg_descs(reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(f"Backend '{backend}' not found. Available backends: {list(self.backends.keys())}")
        return self.agent.queryMem(descs, self.backends[backend])

    def make_connection(self, remote_agent: str, backends: list[str] = []) -> None:  # noqa: B006
        self.agent.makeConnection(remote_agent, self._handles(backends))

    # -- transfers ------------------------------------------------------------------------------------------
    def prep_xfer_dlist(
        self, agent_name: str, xfer_list: Any, mem_type: Optional[str] = None, backends: list[str] = []
    ) -> nixl_prepped_dlist_handle:  # noqa: B006
        if agent_name in ("NIXL_INIT_AGENT", ""):
            agent_name = nixlBind.NIXL_INIT_AGENT
        if type(xfer_list) is nixlBind.nixlXferDList:  # what get_xfer_descs gave: every EPLB READ, twice
            return nixl_prepped_dlist_handle(
                self.agent, self.agent.prepXferDlist(agent_name, xfer_list, self._handles(backends))
            )
        if isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            handle = self.agent.prepXferDlist(agent_name, self.nixl_mems[mem_type], xfer_list, self._handles(backends))
        else:
            descs = self.get_xfer_descs(xfer_list, mem_type)
            handle = self.agent.prepXferDlist(agent_name, descs, self._handles(backends))
        return nixl_prepped_dlist_handle(self.agent, handle)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> tuple[int, int, str]:
        duration, margin, method = self.agent.estimateXferCost(req_handle._handle)
        return (
            duration,
            margin,
            ("ANALYTICAL_BACKEND" if method == nixlBind.NIXL_COST_ANALYTICAL_BACKEND else "UNKNOWN"),
        )

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices: Union[list[int], np.ndarray],
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices: Union[list[int], np.ndarray],
        notif_msg: bytes = b"",
        backends: list[str] = [],
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:  # noqa: B006
        op = self.nixl_ops[operation]
        handle = self.agent.makeXferReq(
            op,
            local_xfer_side._handle,
            local_indices,
            remote_xfer_side._handle,
            remote_indices,
            notif_msg,
            self._handles(backends),
            skip_desc_merge,
        )
        return nixl_xfer_handle(self.agent, handle)

    def initialize_xfer(
        self,
        operation: str,
        local_descs: Any,
        remote_descs: Any,
        remote_agent: str,
        notif_msg: bytes = b"",
        backends: list[str] = [],
    ) -> nixl_xfer_handle:  # noqa: B006
        op = self.nixl_ops[operation]
        handle = self.agent.createXferReq(
            op, local_descs, remote_descs, remote_agent, notif_msg, self._handles(backends)
        )
        return nixl_xfer_handle(self.agent, handle)

    @staticmethod
    def _state(status: Any) -> str:
        return _STATES.get(status, "ERR")

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        return _STATES.get(self.agent.postXferReq(handle._handle, notif_msg), "ERR")

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        return _STATES.get(self.agent.getXferStatus(handle._handle), "ERR")

    def get_xfer_telemetry(self, handle: nixl_xfer_handle):
        return self.agent.getXferTelemetry(handle._handle)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        chosen = self.agent.queryXferBackend(handle._handle)
        return next(name for name, h in self.backends.items() if h == chosen)

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def prep_mem_view(self, dlist: Any, *, backends: Optional[list[str]] = None) -> int:
        return self.agent.prepMemView(dlist, self._handles(backends or []))

    def release_mem_view(self, mvh: int) -> None:
        self.agent.releaseMemView(mvh)

    # -- notifications --------------------------------------------------------------------------------------
    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        return self.agent.getNotifs({}, self._handles(backends))

    def update_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        self.notifs = self.agent.getNotifs(self.notifs, self._handles(backends))
        return self.notifs

    def check_remote_xfer_done(
        self, remote_agent_name: str, lookup_tag: bytes, backends: list[str] = [], tag_is_prefix: bool = True
    ) -> bool:
        self.update_notifs(backends)
        for msg in self.notifs.get(remote_agent_name, []):
            if msg.startswith(lookup_tag) if tag_is_prefix else lookup_tag in msg:
                self.notifs[remote_agent_name].remove(msg)
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: Optional[str] = None) -> None:
        if backend is None:
            self.agent.genNotif(remote_agent_name, notif_msg)
        else:  # 1.5.1 hands the binding a backend handle where it takes a list: every call with a backend fails
            self.backends[backend]  # an unknown name is a KeyError first
            raise TypeError(
                "genNotif(): incompatible function arguments. The following argument types are "
                "supported:\n    1. (self: nixlAgent, remote_agent: str, msg: str, backend: int = 0) "
                "-> None"
            )

    # -- metadata -------------------------------------------------------------------------------------------
    def get_agent_metadata(self) -> bytes:
        return self.agent.getLocalMD()

    def get_partial_agent_metadata(self, descs: Any, inc_conn_info: bool = False, backends: list[str] = []) -> bytes:  # noqa: B006
        return self.agent.getLocalPartialMD(descs, inc_conn_info, self._handles(backends))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return self.agent.loadRemoteMD(metadata)  # bytes, as in 1.5.1 (fact 13)

    def remove_remote_agent(self, agent: str) -> None:
        self.agent.invalidateRemoteMD(agent)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.agent.sendLocalMD(ip_addr, port)

    def send_partial_agent_metadata(
        self,
        descs: Any,
        inc_conn_info: bool = False,
        backends: list[str] = [],
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ) -> None:  # noqa: B006
        self.agent.sendLocalPartialMD(descs, inc_conn_info, self._handles(backends), ip_addr, port, label)

    def fetch_remote_metadata(
        self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = ""
    ) -> None:
        self.agent.fetchRemoteMD(remote_agent, ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.agent.invalidateLocalMD(ip_addr, port)

    def check_remote_metadata(self, agent: str, descs: Any = None) -> bool:
        if descs is None:
            descs = nixlBind.nixlXferDList(nixlBind.DRAM_SEG)
        return self.agent.checkRemoteMD(agent, descs) == nixlBind.NIXL_SUCCESS

    # -- descriptor lists -----------------------------------------------------------------------------------
    def _tensor_rows(self, tensors: list) -> Optional[tuple[str, list[tuple[int, int, int]]]]:
        # get_device() is -1 on the CPU and the index on a GPU: one int compares what two devices would.  Every
        # READ of EPLB comes through here, so each tensor costs four calls.
        device = tensors[0].get_device()
        rows = []
        for t in tensors:
            dev = t.get_device()
            if dev != device:
                return None
            if not t.is_contiguous():
                logger.error("Please use a list of contiguous Tensors")
                return None
            rows.append((t.data_ptr(), t.nbytes, dev if dev > 0 else 0))
        return ("DRAM" if device == -1 else "VRAM"), rows

    def _descs(self, descs: Any, mem_type: Optional[str], cls: Any, arity: int, wrong: type, wrong_msg: str):
        if isinstance(descs, cls):
            return descs
        if isinstance(descs, wrong):
            logger.error(wrong_msg)
            return None
        if _torch_tensor(descs):
            if not descs.is_contiguous():
                logger.error("Please use a list of contiguous Tensors")
                return None
            descs = [descs]
        elif isinstance(descs, np.ndarray):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if descs.ndim != 2 or descs.shape[1] != 3:
                logger.error("Nx3 shape required for transfer descriptor list from numpy array")
                return None
            descs[0]  # an empty (0x3) array fails here with numpy's IndexError, as in the real module
            return cls(self.nixl_mems[mem_type], descs)
        first = descs[0]  # an empty list or None fails here, as it does in the real module
        if isinstance(first, tuple):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if len(first) != arity:
                logger.error(f"{arity}-tuple list needed for " + ("registration" if arity == 4 else "transfer"))
                return None
            return cls(self.nixl_mems[mem_type], descs)
        if _torch_tensor(first):
            found = self._tensor_rows(descs)
            if found is None:
                return None
            return cls._of_triples(self.nixl_mems[found[0]], found[1])
        return None

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None):
        # Every READ of EPLB passes a list of tensors, then a list of (addr, len, dev) tuples: those two take a
        # short way to the answer the general path below gives them.
        if type(descs) is nixlBind.nixlXferDList:
            return descs
        if type(descs) is list and descs:
            first = type(descs[0])
            if first is tuple and mem_type is not None and len(descs[0]) == 3:
                return nixlBind.nixlXferDList(self.nixl_mems[mem_type], descs)
            if first is _tensor_class():
                found = self._tensor_rows(descs)
                return None if found is None else nixlBind.nixlXferDList._of_triples(self.nixl_mems[found[0]], found[1])
        return self._descs(
            descs,
            mem_type,
            nixlBind.nixlXferDList,
            3,
            nixlBind.nixlRegDList,
            "RegList type detected for transfer, please use XferList",
        )

    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None):
        return self._descs(
            descs,
            mem_type,
            nixlBind.nixlRegDList,
            4,
            nixlBind.nixlXferDList,
            "XferList type detected for registration, please use RegList",
        )

    def get_remote_descs(self, descs: Any, mem_type: Optional[str] = None):
        if isinstance(descs, nixlBind.nixlRemoteDList):
            return descs
        if isinstance(descs[0], tuple) and mem_type is not None and len(descs[0]) == 4:
            return nixlBind.nixlRemoteDList(self.nixl_mems[mem_type], descs)
        logger.error("4-tuple list (addr, len, dev_id, agent_name) needed for remote descriptors")
        return None

    def get_serialized_descs(self, descs: Any) -> bytes:
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        return pickle.loads(serialized_descs)
