"""The real deployment: the scenario's timeline (:class:`sim.engine.Engine`) driving one OS process per rank.

The parent hosts the key-value store the ranks' gloo groups meet in, starts rank processes
(:mod:`real_backends.rank`), posts them commands over pipes and collects what they stream back: command completions,
crashes, and every event of their history, each stamped with the host's monotonic clock.  After the run the
events are merged in time order and judged by the simulation's oracles (:mod:`real_backends.judge`).

No process outlives a run: every rank dies with the parent (``PR_SET_PDEATHSIG``), and the parent kills whatever is
left when the run ends, fails or is interrupted.  Everything binds to loopback: the store on 127.0.0.1, gloo on
``lo``, UCX on ``lo`` (host memory moves by shared memory / CMA, which binds nothing).
"""

from __future__ import annotations

import datetime
import itertools
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from sim import faults as fault_catalogue
from sim.engine import PREPARE_POLL_STEPS, Engine
from sim.eplb.state import LoadWindow, Placement
from sim.errors import BackendUnavailable, ScenarioError

from .groups import RealGroup
from .launch import LocalLauncher
from .rank import RankConfig

_cmd_ids = itertools.count(1)
LOOPBACK_ENV = {
    "GLOO_SOCKET_IFNAME": "lo",
    "UCX_NET_DEVICES": "lo",
    "NIXL_LOG_LEVEL": "WARN",
    "UCX_LOG_LEVEL": "error",
    "OMP_NUM_THREADS": "1",
}


class RealFaultRefused(ScenarioError):
    """A fault only the fake NIXL can produce was asked of the real backend."""


REAL_SITES = frozenset(fault_catalogue.GC_SITES) | {"storage.move", "peer.restart", "device.stream_lag"}


def check_real_faults(armed: list[fault_catalogue.Armed], device: str = "cpu") -> None:
    for a in armed:
        if a.site not in REAL_SITES:
            raise RealFaultRefused(
                f"fault {a.site} exists only in the fake NIXL; the real backend injects "
                f"{', '.join(sorted(REAL_SITES))} (and the scenario's fail_rank events)"
            )
        if a.site == "device.stream_lag" and device != "cuda":
            raise RealFaultRefused(
                "fault device.stream_lag delays copies on a CUDA stream: use --device cuda "
                "(host-memory copies run when issued)"
            )


def check_real_all2all(scenario, device: str) -> None:
    """A DeepEP all2all on the real backend needs a GPU and a DeepEP build importable as ``deep_ep``."""
    from .deep_ep_probe import unavailable

    if device != "cuda":
        raise ScenarioError(
            f"all2all.backend {scenario.all2all.backend}: DeepEP's buffers live on GPUs; run it with "
            "--device cuda and a DeepEP build, simulate it, or set all2all.backend=none"
        )
    why = unavailable()
    if why is not None:
        raise BackendUnavailable(f"all2all.backend {scenario.all2all.backend}: {why}")


PREPARE_POLL_S = 5.0  # how long the communicators still building may take before another chunk of serving
START_ALLOWANCE_S = 120.0  # what a rank process may take to start, on top of --timeout
SETTLE_S = 0.2  # once a rank is seen dead, how long the others' answers still on their way are waited for


@dataclass
class Handle:
    """A command posted to a rank: done when it replies (or when the run gives up on it)."""

    pid: int
    kind: str
    event: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    # PREPARE (and a joining rank's standby start) only: set when its background thread built the communicator
    prepared: threading.Event | None = None


class _Clock:
    """What the fault plan needs of a fabric when there is none: the time, and nothing to disarm."""

    class _Board:
        def disarm_all(self) -> None:
            pass

    faults = _Board()

    def now(self) -> float:
        return time.monotonic()


class RankProcess:
    def __init__(self, cluster: "RealCluster", pid: int, cfg: RankConfig) -> None:
        self.cluster, self.pid = cluster, pid
        self.load = LoadWindow(
            cluster.scenario.model.layers, cluster.scenario.model.experts, max(1, cluster.scenario.eplb.window)
        )
        self.alive = True
        self.killed = False  # by fail_rank
        self.pending: dict[int, Handle] = {}
        self.prepare: Handle | None = None
        # What the worker holds, as the commands posted to it imply: which drops a command makes.
        self.has_prepared = False
        self.has_aborted = False  # an aborted PREPARE's communicator waits in the worker until the next PREPARE
        self.prepare_waits = False  # its PREPARE waits for an async rebalance in flight to land (rank.py _prepare)
        self.conn: Any
        self.conn, self.proc = cluster.launcher.start(cfg)
        # Events carry the rank host's monotonic clock: the same clock as this process's on this kernel; a torchrun
        # slot on another host measured its offset at connect, to within clock_bound (real_backends/launch.py).
        info = getattr(self.proc, "info", {})
        self.clock_offset = float(info.get("clock_offset", 0.0))
        self.clock_bound = float(info.get("clock_bound", 0.0))
        # the processes of one host read one clock, placed once (a slot that cannot name its clock is one alone)
        self.clock = info.get("clock_domain") or f"pid {pid}"
        self.reader = threading.Thread(target=self._read, name=f"reader@{pid}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except Exception:  # noqa: BLE001 - closed (the rank's exit, stop_all) or unreadable: the stream ends
                break
            self.cluster.inbox.put((self.pid, msg))
        on_eof = getattr(self.proc, "on_eof", None)  # a torchrun slot is gone when its connection is
        if on_eof is not None:
            on_eof()
        self.cluster.inbox.put((self.pid, ("eof",)))

    def post(self, cmd) -> Handle:
        h = Handle(self.pid, cmd.kind)
        args = dict(cmd.args)
        gc_faults, extra = self.cluster.choose_faults(self, cmd.kind, args)
        args.update(extra)
        if cmd.kind == "prepare" or (cmd.kind == "start" and args.get("standby")):
            # (a joining rank's start builds in the background as a PREPARE does, and says "prepared" too)
            h.prepared = threading.Event()
            self.prepare = h
            if cmd.kind == "prepare":
                self.has_prepared, self.has_aborted = True, False
        elif cmd.kind == "serve":
            self.load.record(args["loads"], args["steps"])
        elif cmd.kind == "abort":
            self.has_aborted, self.has_prepared = self.has_prepared, False
        elif cmd.kind == "commit":
            self.has_prepared = False
        cmd_id = next(_cmd_ids)
        self.pending[cmd_id] = h
        try:
            self.conn.send(("cmd", cmd_id, cmd.kind, args, self.cluster.timeline.step, gc_faults))
        except (OSError, ValueError):
            pass  # a dead rank: the join that waits for it reports it
        return h


class RealCluster:
    def __init__(
        self,
        scenario,
        *,
        seed: int,
        strategy: str,
        faults: Sequence[fault_catalogue.Armed] = (),
        device: str = "cpu",
        timeout_s: float = 120.0,
        on_progress=None,
        launcher=None,
    ) -> None:
        from sim.eplb.communicators import plugins

        check_real_faults(list(faults), device)
        if scenario.all2all.backend != "none":
            check_real_all2all(scenario, device)
        if strategy not in plugins.BUILTIN:
            # A missing or broken strategy is a one-line error before anything starts.  (A built-in is epsim's own
            # module: loading one here would only import torch into a process that has no other use for it, 2.5 s
            # of CPU per run on a 2-core machine; the ranks load it as they start.)
            plugins.load(strategy, fresh=False)
        self.scenario, self.seed, self.strategy, self.device = scenario, seed, strategy, device
        self.timeout_s = timeout_s
        self.events: list[tuple[float, int, int, str, dict[str, Any]]] = []
        self._seq = itertools.count()
        self.faults = fault_catalogue.FaultPlan(list(faults), _Clock(), _Recorder(self))
        # The timeline over this world; on_progress is called with (step, seconds) between lifecycle events.
        self.timeline = Engine(self, scenario, seed, self.faults, on_progress)
        self.inbox: queue.Queue = queue.Queue()
        self.crashed: list[int] = []
        self.stuck: list[str] = []
        self.completed = False  # the timeline ran to its end, shutdown included
        self.t0 = time.monotonic()
        self._store: Any = None  # the run's TCPStore while it runs, where this process hosts it
        self._store_port: int | None = None  # where the ranks find it (a child of the zygote hosts it, if there is one)
        # who starts rank processes: this host, or torchrun's slots
        self.launcher = launcher or LocalLauncher()

    # -- messages from the ranks --------------------------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        """Handle every message that arrives within ``timeout`` seconds (at least one wait)."""
        try:
            item = self.inbox.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, pid: int, msg: tuple) -> None:
        kind = msg[0]
        w: Any = self.timeline.workers.get(pid)  # (None for a rank that never started: only its crash arrives)
        if kind == "event":
            _, t, src, seq, what, fields = msg
            self.events.append((t + w.clock_offset, src, seq, what, fields))
        elif kind == "done":
            h = w.pending.pop(msg[1], None)
            if h is not None:
                h.value = msg[2]
                if h.prepared is not None:
                    h.value = h.prepared
                h.event.set()
        elif kind == "prepared":
            if w.prepare is not None and w.prepare.prepared is not None:
                w.prepare.prepared.set()
        elif kind == "prepare_waits":
            w.prepare_waits = msg[1]
        elif kind == "crash":
            self.crashed.append(pid)
        elif kind == "eof":
            w.alive = False

    # -- the World hooks the engine calls ------------------------------------------------------------------------------
    def record(self, kind: str, **fields: Any) -> None:
        self.events.append((time.monotonic(), -1, next(self._seq), kind, fields))

    def now(self) -> float:
        return time.monotonic() - self.t0

    def new_group(self, name: str, members: list[int]) -> RealGroup:
        return RealGroup(name, list(members))

    def spawn_worker(self, pid: int, group, rank: int, placement: Placement | None) -> RankProcess:
        assert self._store_port is not None  # (run() opened the store before the engine started any rank)
        cfg = RankConfig(
            pid=pid,
            parent=os.getpid(),
            scenario=self.scenario.model_dump(mode="json"),
            strategy=self.strategy,
            device=self._device_of(pid),
            store=(self.launcher.store_host, self._store_port),
            group=group,
            placement=placement,
            timeout_s=self.timeout_s,
        )
        w = RankProcess(self, pid, cfg)
        self.timeline.workers[pid] = w
        # a torchrun slot's placement on this clock, as applied to its events (a local rank shares the clock)
        clock = {"clock_offset_s": w.clock_offset, "clock_bound_s": w.clock_bound} if hasattr(w.proc, "info") else {}
        self.record("process.start", pid=pid, os_pid=w.proc.pid, rank=rank, started_as=w.proc.started_as, **clock)
        return w

    def _device_of(self, pid: int) -> str:
        """One process per GPU: rank processes take the visible GPUs in turn (a torchrun slot uses its own)."""
        if self.device != "cuda":
            return self.device
        import torch

        return f"cuda:{pid % max(1, torch.cuda.device_count())}"

    def join(self, pending: dict[int, Handle], what: str, busy_s: float = 0.0) -> bool:
        # (busy_s: simulated serving time; a rank records a serving chunk's load at once)
        # A new rank's interpreter, torch and NIXL imports come before it can answer "start": not part of the
        # per-command timeout (else --timeout 0.5 would make every run a start-up "stuck").
        startup = START_ALLOWANCE_S if any(h.kind == "start" for h in pending.values()) else 0.0
        deadline = time.monotonic() + self.timeout_s + startup
        settled = False  # a dead rank seen: the others' answers already on their way are read first
        while not all(h.event.is_set() for h in pending.values()):
            if self.crashed:
                return False
            # `alive` turns False only once the rank's end-of-stream is handled, after everything it sent before
            # it (a rank that answered and then exited is not dead to this command).
            dead = [p for p, h in pending.items() if not h.event.is_set() and not self.timeline.workers[p].alive]
            if dead and not settled:
                settled = True
                self._settle(pending, dead)
                continue
            if dead or time.monotonic() > deadline:
                late = [p for p, h in pending.items() if not h.event.is_set()]
                why = f"pids {dead} exited" if dead else f"no answer within {self.timeout_s:g} s"
                self.stuck.append(f"{what}: {why}; waiting for pids {late}")
                self.record("engine.stuck", what=what, pids=late)
                return False
            self._pump(0.05)
        return not self.crashed

    def _settle(self, pending: dict[int, Handle], dead: list[int]) -> None:
        """Up to SETTLE_S for the living ranks' answers, so that a stuck command names only the ranks that never
        answer (one pump returns with the first message, often another rank's event, not after the wait)."""
        until = time.monotonic() + SETTLE_S
        while not self.crashed and any(not h.event.is_set() for p, h in pending.items() if p not in dead):
            left = until - time.monotonic()
            if left <= 0:
                return
            self._pump(left)

    def prepared(self, handles: dict[int, Handle]) -> bool:
        # Serving goes on while PREPARE runs, in chunks of PREPARE_POLL_STEPS steps.  A real chunk takes no time
        # unless a rebalance is in flight, so the communicators still building after the scenario's prepare_s of
        # steps are waited for here, up to PREPARE_POLL_S, before another chunk: the steps served then are as many
        # as the simulation's (where every PREPARE takes prepare_s), however long NIXL agents take to start here.
        # A PREPARE that waits for a rebalance in flight (_prepare in rank.py) is not waited for: it needs the steps
        # of the next chunk to take the layers that end its wait.
        deadline = time.monotonic() + max(PREPARE_POLL_S, PREPARE_POLL_STEPS * self.scenario.serving.step_time_s)
        while True:
            late = [p for p, h in handles.items() if not h.value.is_set()]
            if not late:
                return True
            if self.crashed or time.monotonic() > deadline:
                return False
            if any(self.timeline.workers[p].prepare_waits for p in late):
                return False
            self._pump(0.01)

    def prepare_limit_s(self, prepare_s: float) -> float:
        return prepare_s + self.timeout_s

    def prepare_never_finished(self, handles: dict[int, Handle], limit: float) -> None:
        late = [p for p, h in handles.items() if not h.value.is_set()]
        self.stuck.append(f"PREPARE: not finished within {limit:g} s while the group served; waiting for pids {late}")
        self.record("engine.stuck", what="PREPARE", pids=late)

    def fail_rank(self, pid: int) -> None:
        w = self.timeline.workers[pid]
        w.proc.kill()
        w.proc.join(10)
        w.alive, w.killed = False, True
        self.record("process.kill", pid=pid, signal="SIGKILL")

    def end_process(self, pid: int) -> None:
        w = self.timeline.workers[pid]
        if w.proc.is_alive() and not hasattr(w.proc, "on_eof"):
            _half_close(w.conn)  # a rank whose exit command crashed waits for the next command: EOF ends it
        w.proc.join(self.timeout_s)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(10)
        w.alive = False
        self.record("process.exit", pid=pid, code=w.proc.exitcode)

    def rocm(self) -> bool:
        if self.device != "cuda":
            return False  # (without importing torch, which a run on host memory does not need in this process)
        import torch

        return getattr(torch.version, "hip", None) is not None

    def reconfigured(self, members: list[int]) -> None:
        self.record("engine.reconfigured", members=list(members))

    def exited(self) -> None:
        for p in list(self.timeline.members):
            if not self.timeline.workers[p].killed:  # recorded for every rank, so the judge knows its agents are gone
                self.end_process(p)
        self.completed = not self.crashed and not self.stuck

    # Real processes need nothing at these points: their sends and collections take their own time, and the
    # parent's waits end by themselves.
    def dispatching(self, kind: str, pids: list[int]) -> None:
        pass

    def dispatch_gap(self) -> None:
        pass

    def before_rebalance(self) -> None:
        pass

    def halt(self) -> None:
        pass

    # -- faults decided by the parent ---------------------------------------------------------------------------
    def choose_faults(
        self, w: RankProcess, kind: str, args: dict[str, Any]
    ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """The GC fault each communicator this command drops gets (what -> fault), and the worker faults of a
        PREPARE or a rearrange, taken from the plan here so that ``times`` counts across processes as in the
        simulation.  A PREPARE's are those of the step its window ends at (``build_step``), decided when the command
        is posted, as the simulation decides them (its PREPARE builds at that step; the real rank at once)."""
        a2a = self.scenario.all2all.backend != "none"
        drops = {
            "commit": ["old communicator"] + ["old all2all buffer"] * a2a,
            "exit": ["prepared"] * w.has_prepared
            + ["aborted"] * w.has_aborted
            + ["communicator at exit"]
            + ["all2all buffer at exit"] * a2a,
            "prepare": ["aborted communicator"] * w.has_aborted,
        }.get(kind, [])
        gc_faults = {}
        for what in drops:
            fault = self.faults.take_gc(w.pid, what)
            if fault is not None:
                gc_faults[what] = {"site": fault.site, **fault.params}
        extra: dict[str, Any] = {}
        if kind == "rearrange":
            lag = self.faults.take(
                {"device.stream_lag": fault_catalogue.WORKER_SITES["device.stream_lag"]}, w.pid, "expert copies"
            )
            if lag is not None:
                extra["stream_lag_s"] = float(lag.params.get("delay_s", 0.01))
        if kind == "prepare":
            fired = self.faults.take_prepare(w.pid, args.get("build_step"))
            extra["storage_move"], extra["peer_restart"] = fired["storage.move"], fired["peer.restart"]
        return gc_faults, extra

    # -- the run ------------------------------------------------------------------------------------------------
    def run(self) -> None:
        env = LOOPBACK_ENV if self.launcher.loopback else {"NIXL_LOG_LEVEL": "WARN", "OMP_NUM_THREADS": "1"}
        saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update({k: v for k, v in env.items() if k not in os.environ or k == "OMP_NUM_THREADS"})
        previous = (
            signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() else None
        )
        try:
            self.launcher.open(self.scenario)
            self._store_port = self.launcher.store_port(self.timeout_s)
            if self._store_port is None:
                from torch.distributed import TCPStore

                self._store = TCPStore(
                    self.launcher.store_host,
                    0,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=self.timeout_s),
                )
                self._store_port = self._store.port
            self.timeline.engine()
        finally:
            self.stop_all()
            self.launcher.close()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def stop_all(self, grace_s: float = 5.0) -> None:
        """Every rank process ends: those still running get ``grace_s`` to finish, then SIGKILL; their last
        messages are collected."""
        for w in self.timeline.workers.values():
            if not w.proc.is_alive():
                continue
            if hasattr(w.proc, "on_eof"):
                w.proc.kill()  # a torchrun slot: told to end now (its connection is the only way to reach it)
            else:
                _half_close(w.conn)  # a rank waiting for a command reads EOF and exits the normal way
        deadline = time.monotonic() + grace_s
        for w in self.timeline.workers.values():
            w.proc.join(max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(10)
                self.record("process.kill", pid=w.pid, signal="SIGKILL", why="still running at the end of the run")
        for w in self.timeline.workers.values():
            w.reader.join(5)
            w.conn.close()
        self._pump(0.0)
        self._store = None


class _Recorder:
    """The history interface the fault plan records into."""

    def __init__(self, cluster: RealCluster) -> None:
        self.cluster = cluster

    def record(self, kind: str, **fields: Any) -> None:
        self.cluster.record(kind, **fields)


def _half_close(conn) -> None:
    """Shut down the parent's sending side of a rank's pipe: the rank reads EOF, while the reader thread still
    gets everything the rank sends until it exits (closing the descriptor would not wake a blocked reader)."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except (OSError, ValueError):
        return
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        sock.close()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
