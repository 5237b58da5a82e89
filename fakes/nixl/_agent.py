"""The fake ``nixlAgent`` core: identity, backends and lifetime.  Call families live in mixins beside it.

Lifetime follows the real one: the Python ``nixl_agent`` and every handle wrapper hold this object, so it dies when
the last of them does (row 27 of the reference); its ``__del__`` is NIXL's destructor: deregister everything, unload
peers, stop.  Peers are not told (row 28); they find out at their next operation.
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

# The fake implements one transport plugin.  Real wheels list more (GDS, POSIX, ...); asking the fake for them
# fails the same way an unknown plugin does, and docs/fake_coverage.md says so.
PLUGINS = ["UCX"]
UCX_MEM_TYPES = ["DRAM_SEG", "VRAM_SEG"]


@dataclass
class nixlAgentConfig:
    useProgThread: bool = True
    useListenThread: bool = False
    listenPort: int = 8888
    syncMode: int = 0
    pthrDelay: int = 0
    lthrDelay: int = 100000
    captureTelemetry: bool = False


class AgentCore(MemoryMixin, PeersMixin, XferMixin):
    """One C++ ``nixlAgent``: the object behind ``nixl_agent.agent``."""

    def __init__(self, name: str, config: nixlAgentConfig | None = None) -> None:
        if not isinstance(name, str):
            raise TypeError("nixlAgent(): incompatible constructor arguments")
        if not name:
            raise ValueError("Agent needs a non-empty name")
        fabric: FakeFabric = current_fabric()
        fabric.progress()
        self.fabric = fabric
        self.name = name
        self.config = config or nixlAgentConfig()
        self.pid = fabric.current_process()
        self.uid = fabric.new_id()
        # Connection identity: what a peer compares when the same name is loaded again (row 1).
        self.conn = f"ucx://{self.pid}/{self.uid:x}/{name}"
        self.destroyed = False
        self.backends: dict[int, str] = {}
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
        return {}, list(UCX_MEM_TYPES)

    def createBackend(self, backend: str, params: dict[str, str] | None = None) -> int:
        self._enter()
        if backend in self.backends.values():
            S.fail(S.INVALID_PARAM, f"createBackend: backend already created for type '{backend}'")
        if backend not in PLUGINS:
            S.fail(S.NOT_FOUND, f"createBackend: unsupported backend '{backend}'")
        handle = 0x5000_0000_0000 + self.fabric.new_id() * 0x100
        self.backends[handle] = backend
        return handle

    def getBackendParams(self, handle: int) -> tuple[dict[str, str], list[str]]:
        if handle not in self.backends:
            S.fail(S.NOT_FOUND, "getBackendParams: backend not found")
        return {}, list(UCX_MEM_TYPES)

    def _has_backend_for(self, mem: S.nixl_mem_t) -> bool:
        return bool(self.backends) and mem.name in UCX_MEM_TYPES

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
                fabric.emit("agent.threads", agent=self.name, pid=self.pid, conn=self.conn,
                            thread=getattr(me, "name", str(me)), others=others,
                            open=sum(n for t, n in owners.items() if t is not me))

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

    def sendLocalPartialMD(self, descs: Any, inc_conn_info: bool, backends: list, ip_addr: str = "",
                           port: int = 8888, label: str = "") -> None:
        self._no_transport(ip_addr)

    def fetchRemoteMD(self, remote_agent: str, ip_addr: str = "", port: int = 8888, label: str = "") -> None:
        self._no_transport(ip_addr)

    def invalidateLocalMD(self, ip_addr: str = "", port: int = 8888) -> None:
        self._no_transport(ip_addr)

    def _no_transport(self, ip_addr: str) -> None:
        if not ip_addr:
            S.fail(S.INVALID_PARAM, "noTransport: no peer address provided and no centralized store configured "
                                    "(set NIXL_ETCD_ENDPOINTS or NIXL_TCPSTORE_ENDPOINT)")
        # Towards an address the real agent only logs and works asynchronously; the fake has no sockets.
        S.log.info("fake NIXL: socket metadata exchange with %s is not modelled", ip_addr)

    def queryMem(self, descs: Any, backend: int) -> list:
        S.fail(S.NOT_SUPPORTED, "queryMem: not supported by the UCX backend")

    def prepMemView(self, dlist: Any, backends: list) -> int:
        S.fail(S.BACKEND, "prepMemView: UCX was built without the GPU device API")

    def releaseMemView(self, mvh: int) -> None:
        S.fail(S.INVALID_PARAM, "releaseMemView: unknown memory view")


def restart_in_place(core: AgentCore) -> AgentCore:
    """The agent's process restarts its NIXL side under the same name (the reference's fault 6): the old agent is
    gone for its peers, a fresh one with a new connection and no peers loaded registers the same memory again, and
    the process's ``nixl_agent`` objects now hold the new agent, as the restarted process's own would.  Peers that
    kept the old entry get NOT_ALLOWED when they load the name again without removing it first.

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
