"""The fake ``nixlAgent`` core: identity, backends and lifetime.  Call families live in mixins beside it.

Lifetime follows the real one: the Python ``nixl_agent`` and every handle wrapper hold this object, so it dies when
the last of them does (fact 27 of docs/reference/nixl-1.5.1.md); its ``__del__`` is NIXL's destructor: deregister
everything, unload peers, stop.  Peers are not told (fact 28); they find out at their next operation.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from . import _status as S
from ._dlist import nixlRegDList
from ._fabric import FakeFabric, current_fabric
from ._memory import MemoryMixin
from ._peers import PeersMixin
from ._xfer import XferMixin

# The fake implements one transport plugin, UCX, and of POSIX what a client asks before it moves file data: its
# parameters and queryMem (the file's size, mode and modification time).  POSIX registrations and transfers are
# not modelled: they fail NIXL_ERR_NOT_SUPPORTED, saying so.  Real wheels list more (GDS, OBJ, ...); asking the fake
# for them fails the same way an unknown plugin does, and docs/fake_coverage.md says so.
PLUGINS = ["POSIX", "UCX"]
UCX_MEM_TYPES = ["DRAM_SEG", "VRAM_SEG"]
# What getPluginParams("POSIX") gives on 1.5.1 (case posix_query_mem): its defaults, and the memory it takes.
POSIX_PARAMS = {
    "use_posix_aio": "false",
    "use_uring": "false",
    "use_aio": "false",
    "kernel_queue_size": "256",
    "ios_pool_size": "65536",
}
PLUGIN_PARAMS = {"UCX": ({}, UCX_MEM_TYPES), "POSIX": (POSIX_PARAMS, ["DRAM_SEG", "FILE_SEG"])}
BACKEND_MEM_TYPES = {"UCX": UCX_MEM_TYPES, "POSIX": ["FILE_SEG", "DRAM_SEG"]}  # getBackendParams's order


@dataclass
class nixlAgentConfig:
    useProgThread: bool = True
    useListenThread: bool = False
    listenPort: int = 8888
    syncMode: int = 0
    pthrDelay: int = 0
    lthrDelay: int = 100000
    captureTelemetry: bool = False


# NIXL_TELEMETRY_ENABLE, read when an agent is made (observed on 1.5.1, case telemetry_switches): set, it decides
# whether transfers keep telemetry whatever the config's captureTelemetry says (no sink or directory is needed);
# unset, the config decides; a value outside these words fails the agent's construction.
_TELEMETRY_WORDS = {
    **dict.fromkeys(("y", "yes", "on", "1", "true", "enable"), True),
    **dict.fromkeys(("n", "no", "off", "0", "false", "disable"), False),
}


def telemetry_enabled(config: nixlAgentConfig) -> bool:
    import os

    value = os.environ.get("NIXL_TELEMETRY_ENABLE")
    if value is None:
        return bool(config.captureTelemetry)
    if value.lower() not in _TELEMETRY_WORDS:
        raise RuntimeError(
            f"Conversion to bool failed for string '{value}' known are y, yes, on, 1, true, enable as "
            "positive and n, no, off, 0, false, disable as negative (case insensitive)"
        )
    return _TELEMETRY_WORDS[value.lower()]


class AgentCore(MemoryMixin, PeersMixin, XferMixin):
    """One C++ ``nixlAgent``: the object behind ``nixl_agent.agent``."""

    def __init__(self, name: str, config: nixlAgentConfig | None = None) -> None:
        if not isinstance(name, str):
            raise TypeError("nixlAgent(): incompatible constructor arguments")
        if not name:
            raise ValueError("Agent needs a non-empty name")
        self.config = config or nixlAgentConfig()
        self.telemetry = telemetry_enabled(self.config)
        fabric: FakeFabric = current_fabric()
        fabric.progress()
        self.fabric = fabric
        self.name = name
        self.pid = fabric.current_process()
        fabric.agent_made(self.pid)
        self.uid = fabric.new_id()
        # Connection identity: what a peer compares when the same name is loaded again (fact 1).
        self.conn = f"ucx://{self.pid}/{self.uid:x}/{name}"
        self.destroyed = False
        self.backends: dict[int, str] = {}
        self.backend_params: dict[int, dict[str, str]] = {}
        self._init_memory()
        self._init_peers()
        self._init_xfer()
        self.wrappers: weakref.WeakSet = weakref.WeakSet()  # the nixl_agent objects on this agent (restart_in_place)
        fabric.conns[self.conn] = self
        fabric.emit("agent.create", agent=name, pid=self.pid, conn=self.conn)

    def __repr__(self) -> str:
        state = "destroyed" if self.destroyed else "live"
        return f"<nixlAgent {self.name!r} pid={self.pid} {state} regions={len(self.regions)}>"

    # -- plugins and backends -------------------------------------------------------------------------------
    def getAvailPlugins(self) -> list[str]:
        return list(PLUGINS)

    def getPluginParams(self, plugin: str) -> tuple[dict[str, str], list[str]]:
        if plugin not in PLUGINS:
            S.fail(S.NOT_FOUND, f"getPluginParams: plugin '{plugin}' not found")
        params, mems = PLUGIN_PARAMS[plugin]
        return dict(params), list(mems)

    def createBackend(self, backend: str, params: dict[str, str] | None = None) -> int:
        self._enter()
        if backend in self.backends.values():
            S.fail(S.INVALID_PARAM, f"createBackend: backend already created for type '{backend}'")
        if backend not in PLUGINS:
            S.fail(S.NOT_FOUND, f"createBackend: unsupported backend '{backend}'")
        handle = 0x5000_0000_0000 + self.fabric.new_id() * 0x100
        self.backends[handle] = backend
        self.backend_params[handle] = {**PLUGIN_PARAMS[backend][0], **dict(params or {})}
        return handle

    def getBackendParams(self, handle: int) -> tuple[dict[str, str], list[str]]:
        if handle not in self.backends:
            S.fail(S.NOT_FOUND, "getBackendParams: backend not found")
        return dict(self.backend_params[handle]), list(BACKEND_MEM_TYPES[self.backends[handle]])

    def _has_backend_for(self, mem: S.nixl_mem_t) -> bool:
        return "UCX" in self.backends.values() and mem.name in UCX_MEM_TYPES

    def _refuse_posix_only(self, backends: list | None, call: str) -> None:
        """A call for POSIX backends alone: the fake does not move file data."""
        if backends and all(self.backends.get(int(b)) == "POSIX" for b in backends):
            S.fail(
                S.NOT_SUPPORTED,
                f"{call}: the fake's POSIX backend answers queryMem only (registrations and "
                "transfers through it are not modelled)",
            )

    # -- lifetime -------------------------------------------------------------------------------------------
    def _enter(self) -> None:
        """Start of every call: let the fabric make progress (complete transfers, deliver notifications), and note
        a call from one thread while another holds open transfer requests on this agent."""
        fabric = self.fabric
        pending, clock = fabric._pending, fabric._clock
        if clock is None or (pending and pending[0][0] <= clock()):  # else progress() would find nothing due
            fabric.progress()
        owners = self.req_owners
        if owners and fabric.thread_of is not None and not self.config.syncMode:  # NONE: no locking inside
            me = fabric.thread_of()
            if len(owners) > 1 or me not in owners:
                others = sorted(getattr(t, "name", str(t)) for t in owners if t is not me)
                fabric.emit(
                    "agent.threads",
                    agent=self.name,
                    pid=self.pid,
                    conn=self.conn,
                    thread=getattr(me, "name", str(me)),
                    others=others,
                    open=sum(n for t, n in owners.items() if t is not me),
                )

    def _vanish(self) -> None:
        """The agent is gone (destructor or killed process): nothing it held is reachable any more."""
        if self.destroyed:
            return
        self.destroyed = True
        self.fabric.conns.pop(self.conn, None)
        self.regions.clear()
        self.region_index.clear()
        self.peers.clear()
        self.fabric.emit("agent.destroy", agent=self.name, pid=self.pid, conn=self.conn)

    def __del__(self) -> None:
        try:
            self._vanish()
        except Exception:  # a destructor never raises, also at interpreter shutdown
            pass

    # -- not modelled: these need a central metadata store or a GPU device API -------------------------------
    def sendLocalMD(self, ip_addr: str = "", port: int = 8888) -> None:
        self._no_transport(ip_addr)

    def sendLocalPartialMD(
        self, descs: Any, inc_conn_info: bool, backends: list, ip_addr: str = "", port: int = 8888, label: str = ""
    ) -> None:
        self._no_transport(ip_addr)

    def fetchRemoteMD(self, remote_agent: str, ip_addr: str = "", port: int = 8888, label: str = "") -> None:
        self._no_transport(ip_addr)

    def invalidateLocalMD(self, ip_addr: str = "", port: int = 8888) -> None:
        self._no_transport(ip_addr)

    def _no_transport(self, ip_addr: str) -> None:
        if not ip_addr:
            S.fail(
                S.INVALID_PARAM,
                "noTransport: no peer address provided and no centralized store configured "
                "(set NIXL_ETCD_ENDPOINTS or NIXL_TCPSTORE_ENDPOINT)",
            )
        # Towards an address the real agent only logs and works asynchronously; the fake has no sockets.
        S.log.info("fake NIXL: socket metadata exchange with %s is not modelled", ip_addr)

    def queryMem(self, descs: Any, backend: int) -> list:
        """POSIX: for each descriptor, the file its metaInfo names: ``{"mtime", "mode", "size"}`` as strings, or
        None where it cannot be stat'ed (whatever the list's memory type; observed on 1.5.1).  UCX: not supported."""
        import os

        if self.backends.get(int(backend)) != "POSIX":
            S.fail(S.NOT_SUPPORTED, "queryMem: not supported by the UCX backend")
        out: list = []
        for i in range(descs.descCount()):
            try:
                st = os.stat(descs[i][3])
            except (OSError, ValueError):
                out.append(None)
                continue
            out.append({"mtime": str(int(st.st_mtime)), "mode": str(st.st_mode), "size": str(st.st_size)})
        return out

    def prepMemView(self, dlist: Any, backends: list) -> int:
        S.fail(S.BACKEND, "prepMemView: UCX was built without the GPU device API")

    def releaseMemView(self, mvh: int) -> None:
        S.fail(S.INVALID_PARAM, "releaseMemView: unknown memory view")


def restart_in_place(core: AgentCore) -> AgentCore:
    """The agent's process restarts its NIXL side under the same name (vLLM fault 6 of docs/reference/vllm-eplb.md): the
    old agent is gone for its peers, a fresh one with a new connection and no peers loaded registers the same memory
    again, and the process's ``nixl_agent`` objects now hold the new agent, as the restarted process's own would.  Peers
    that kept the old entry get NOT_ALLOWED when they load the name again without removing it first.

    Call it from the agent's own simulated process (the simulator's worker thread, or ``fabric.process(pid)``).
    """
    fabric = core.fabric
    regions = list(core.regions)
    backends = dict(core.backends)
    core._vanish()
    new = AgentCore(core.name, core.config)
    if new.pid != core.pid:
        raise RuntimeError(f"restart_in_place of an agent of process {core.pid} called from process {new.pid}")
    handles = {old: new.createBackend(name) for old, name in backends.items()}
    for r in regions:  # registration order, one call each
        new.registerMem(nixlRegDList(S.nixl_mem_t(r.mem), [(r.addr, r.length, r.dev, b"")]), [])
    for wrapper in list(core.wrappers):
        wrapper.agent = new
        wrapper.backends = {name: handles.get(h, h) for name, h in wrapper.backends.items()}
        new.wrappers.add(wrapper)
    fabric.emit("agent.restart", agent=core.name, pid=core.pid, conn=new.conn, old_conn=core.conn)
    return new
