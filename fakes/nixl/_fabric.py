"""The fabric: the world fake NIXL agents live in (fakeredis's "server").

It owns everything that is shared between agents: the simulated processes and which of them is calling, the live
agents by connection identity, memory given back to the allocator, transfers and notifications in flight, the
behaviour profile and the fault board.  Agents are thin; the fabric decides when things happen.

Time: inside the simulator the fabric reads the simulated clock and transfers complete after the time the
:class:`TimeModel` gives.  Outside it, time is a *tick* counter advanced by every agent call, which stands in for
NIXL's progress thread: a transfer that takes ``k`` ticks completes during the ``k``-th fabric call after its post,
whoever makes that call.  Either way nothing depends on the wall clock, so runs are reproducible.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from . import profiles as _profiles
from ._faults import FaultBoard

if TYPE_CHECKING:
    from ._agent import AgentCore


@dataclass(frozen=True)
class TimeModel:
    """How long things take inside the simulator (seconds).  ``epsim`` calibrates it against real NIXL."""

    xfer_latency_s: float = 5e-6  # per transfer request; concurrent requests overlap it
    bandwidth_Bps: float = 40e9  # of the initiating process's link, which its concurrent requests share
    notif_latency_s: float = 5e-6
    connect_s: float = 0.0  # the first transfer towards a peer also waits for the endpoint's wire-up
    post_s: float = 0.0  # a transfer's own host cost, taking its turn on the initiator's link with the bytes
    # The host time a call holds its caller (0 by default: calls take no time).  The first agent of a process loads
    # UCX's transports; an agent's first add_remote_agent wires up more than its later ones (both measured).
    first_agent_s: float = 0.0
    agent_s: float = 0.0
    register_s: float = 0.0
    first_remote_setup_s: float = 0.0
    remote_setup_s: float = 0.0

    def wire_seconds(self, nbytes: int) -> float:
        """How long ``nbytes`` occupy the initiator's link."""
        return nbytes / self.bandwidth_Bps

    def xfer_seconds(self, nbytes: int) -> float:
        """One transfer alone: its fixed cost, then its bytes on the link."""
        return self.xfer_latency_s + self.wire_seconds(nbytes)


@dataclass
class _SimProcess:
    pid: int
    name: str
    alive: bool = True


class FakeFabric:
    """Shared state of one world of fake NIXL agents."""

    def __init__(
        self,
        profile: str | _profiles.Profile = _profiles.DEFAULT,
        *,
        clock: Callable[[], float] | None = None,
        time_model: TimeModel | None = None,
        transport: str = "cma",
        whoami: Callable[[], int] | None = None,
    ) -> None:
        self.profile = _profiles.get(profile) if isinstance(profile, str) else profile
        if transport not in ("cma", "tcp"):
            raise ValueError(f"transport {transport!r} not known; use 'cma' or 'tcp'")
        self.transport = transport
        self.time_model = time_model or TimeModel()
        self._clock = clock
        self._tick = 0
        self._whoami = whoami
        self._pid_stack = [0]
        self.processes: dict[int, _SimProcess] = {0: _SimProcess(0, "main")}
        # Connection identity -> live agent.  Weak: the fabric must not keep an agent alive, since an agent's
        # death (by refcount or by the garbage collector) is exactly what the simulator studies.
        self.conns: weakref.WeakValueDictionary[str, AgentCore] = weakref.WeakValueDictionary()
        self._ids = itertools.count(1)
        self._pending: list[tuple[float, int, Callable[[], None]]] = []  # (due, seq, action) heap
        self._link_free: dict[int, float] = {}  # simulated: process -> when its link has carried what it posted
        self._freed: list[tuple[int, int]] = []  # [lo, hi) ranges given back to the allocator
        self.faults = FaultBoard(self.now)
        # Who hears what happens.  ``listeners`` get every event as (kind, fields).  The simulator, which sees two
        # transfer events per READ (half of a run's events), splits them: ``event_listeners`` get every event but
        # a transfer's post and completion, ``xfer_listeners`` get those two as (kind, agent core, request, the
        # connection of the agent on the other side or None), read in place instead of copied into a dict of fields
        # (which is built only if ``listeners`` is not empty); ``request.spans`` holds the local and remote
        # (addr, len) spans.
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self.event_listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self.xfer_listeners: list[Callable[[str, Any, Any, str | None], None]] = []
        # Inside the simulator: called when a state check finds a transfer still in flight, with the time its
        # completion is due (inf if never).  The kernel sleeps the polling thread until then, which is what a
        # polling loop costs in simulated time without one event per spin.
        self.poll_wait: Callable[[float], None] | None = None
        # Inside the simulator: holds the calling simulated thread for a call's own host time (seconds, why), as
        # the time model gives it; None outside, where calls take no time.
        self.spend: Callable[[float, str], None] | None = None
        self._agent_pids: set[int] = set()  # processes that have made an agent (the first pays UCX's start-up)
        # Inside the simulator: the simulated thread making the current call.  An agent of 1.5.1 runs in sync mode
        # NONE (no listener thread), so two threads using one agent at once race; the fake reports such use as an
        # "agent.threads" event and leaves the verdict to the caller.
        self.thread_of: Callable[[], Any] | None = None

    def __repr__(self) -> str:
        return f"<FakeFabric profile={self.profile.name!r} agents={len(self.conns)} now={self.now():g}>"

    # -- time ------------------------------------------------------------------------------------------------
    @property
    def simulated(self) -> bool:
        return self._clock is not None

    def now(self) -> float:
        return self._clock() if self._clock is not None else float(self._tick)

    def xfer_duration(self, nbytes: int, op: str, wired: bool, pid: int) -> float:
        """Ticks (or simulated seconds) from post to completion.  ``wired``: the endpoint is already connected.

        Simulated, the transfers a process posts share its link, first posted first served: a transfer's bytes
        start after its fixed cost (and the wire-up of a new endpoint) and once the link has carried the bytes of
        the process's earlier transfers.  One transfer alone takes ``xfer_seconds``; k posted together, the last
        done after the fixed cost and k times the bytes, as k READs posted at once by one process measured on
        host memory and on an H200 (``docs/validation.md``, "Concurrent READs share the initiator's bandwidth").
        The target's side is not a shared resource in this model.  ``pid``: the initiating process."""
        if self.simulated:
            model = self.time_model
            now = self.now()
            ready = now + model.xfer_latency_s + (0.0 if wired else model.connect_s)
            done = max(ready, self._link_free.get(pid, ready)) + model.post_s + model.wire_seconds(nbytes)
            self._link_free[pid] = done
            return done - now
        if self.transport == "tcp":
            return 3.0
        # cma on one host: a transfer on a connected endpoint is done when transfer() returns; the first one
        # towards a peer, READ or WRITE, waits for the endpoint's wire-up, i.e. the next progress step (1.5.1 gave
        # PROC for a first WRITE in every fresh process tried, 4 KiB and 1 MiB, where fact 17 says
        # DONE: it measured WRITEs on endpoints a READ had connected).
        return 0.0 if wired else 1.0

    def host_time(self, seconds: float, why: str) -> None:
        """A call's own host time: the calling simulated thread is held that long (nothing outside the simulator,
        or when the time model gives none)."""
        if seconds > 0.0 and self.spend is not None:
            self.spend(seconds, why)

    def agent_made(self, pid: int) -> None:
        """Process ``pid`` makes an agent: the first one costs what loading UCX costs, later ones less."""
        first = pid not in self._agent_pids
        self._agent_pids.add(pid)
        model = self.time_model
        self.host_time(model.first_agent_s if first else model.agent_s, "creating a NIXL agent")

    def notif_delay(self) -> float:
        return self.time_model.notif_latency_s if self.simulated else 0.0

    def schedule(self, delay: float, action: Callable[[], None]) -> float:
        """Run ``action`` once ``delay`` has passed; returns the due time (inf: never, e.g. a stuck transfer)."""
        if math.isinf(delay):
            return math.inf
        due = self.now() + delay
        heapq.heappush(self._pending, (due, next(self._ids), action))
        return due

    def progress(self) -> None:
        """Run everything that is due.  Every agent call starts here (NIXL's progress thread, made explicit)."""
        clock, pending = self._clock, self._pending
        if clock is None:
            self._tick += 1
            now = float(self._tick)
        elif not pending:
            return
        else:
            now = clock()
        while pending and pending[0][0] <= now:
            _, _, action = heapq.heappop(pending)
            action()

    # -- who is calling -------------------------------------------------------------------------------------
    def current_process(self) -> int:
        return self._whoami() if self._whoami is not None else self._pid_stack[-1]

    @contextlib.contextmanager
    def process(self, pid: int) -> Iterator[int]:
        """Run a block as simulated process ``pid`` (outside the simulator, which says this itself)."""
        if pid not in self.processes:
            raise LookupError(f"simulated process {pid} not found; spawn it with fabric.spawn_process()")
        self._pid_stack.append(pid)
        try:
            yield pid
        finally:
            self._pid_stack.pop()

    def spawn_process(self, name: str | None = None) -> int:
        pid = max(self.processes) + 1
        self.processes[pid] = _SimProcess(pid, name or f"proc{pid}")
        self.emit("process.spawn", pid=pid)
        return pid

    def kill_process(self, pid: int) -> None:
        """SIGKILL: the process's agents vanish without a word to their peers, as with real NIXL (facts 30, 31)."""
        # The simulator names its processes itself (whoami); the fabric learns of one when it dies.
        proc = self.processes.setdefault(pid, _SimProcess(pid, f"proc{pid}"))
        proc.alive = False
        for conn in sorted(self.conns.keys()):
            core = self.conns.get(conn)
            if core is not None and core.pid == pid:
                core._vanish()
        self.emit("process.kill", pid=pid)

    def alive(self, pid: int) -> bool:
        proc = self.processes.get(pid)
        return proc is None or proc.alive

    def live_agent(self, conn: str | None) -> AgentCore | None:
        """The agent behind connection ``conn`` if it exists and its process is alive (asked twice per transfer:
        reads the weak dictionary's references directly instead of through its Python-level ``get``)."""
        ref = self.conns.data.get(conn)  # type: ignore[attr-defined]  # WeakValueDictionary's own dict
        core = ref() if ref is not None else None
        if core is None:
            return None
        proc = self.processes.get(core.pid)
        return core if proc is None or proc.alive else None

    # -- memory ---------------------------------------------------------------------------------------------
    def free(self, addr: int, length: int) -> None:
        """Memory at [addr, addr+length) was given back to the OS (munmap, a freed CUDA allocation)."""
        self._freed.append((addr, addr + length))
        self.emit("memory.free", addr=addr, length=length)

    def reuse(self, addr: int, length: int) -> None:
        """The allocator handed [addr, addr+length) out again."""
        lo, hi = addr, addr + length
        self._freed = [r for r in self._freed if r[1] <= lo or r[0] >= hi]

    def has_freed(self) -> bool:
        return bool(self._freed)

    def is_freed(self, addr: int, length: int) -> bool:
        if not self._freed:
            return False
        hi = addr + max(length, 1)
        return any(lo < hi and addr < rhi for lo, rhi in self._freed)

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def new_id(self) -> int:
        return next(self._ids)

    def emit(self, kind: str, **fields: Any) -> None:
        for listener in self.listeners:
            listener(kind, fields)
        for listener in self.event_listeners:
            listener(kind, fields)


_local = threading.local()
_default: FakeFabric | None = None


def default_fabric() -> FakeFabric:
    """The process-wide fabric that makes the fake usable in a plain test, exactly like the real NIXL."""
    global _default
    if _default is None:
        _default = FakeFabric()
    return _default


def current_fabric() -> FakeFabric:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else default_fabric()


@contextlib.contextmanager
def use_fabric(fabric: FakeFabric) -> Iterator[FakeFabric]:
    """Agents created inside the block live in ``fabric`` (the simulator gives every run its own)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(fabric)
    try:
        yield fabric
    finally:
        stack.pop()


def reset_default_fabric(profile: str = _profiles.DEFAULT, **kwargs: Any) -> FakeFabric:
    global _default
    _default = FakeFabric(profile, **kwargs)
    return _default
