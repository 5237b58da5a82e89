"""The simulated deployment: an engine thread that drives simulated workers through a scenario's timeline.

One :class:`Cluster` is one run: its own kernel, fake-NIXL fabric, process groups, workers, GC controller, fault
plan and oracles.  The timeline itself (serving, rebalances, elastic events, healing, shutdown) is
:class:`sim.engine.Engine`, shared with the real-process world; a cluster is the world it drives, in simulated time.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any, Sequence, TYPE_CHECKING

import numpy as np

import fakes
from fakes import torch_dist
from fakes.nixl import FakeFabric, TimeModel

from . import device
from . import faults as fault_catalogue
from .engine import Engine
from .eplb import move
from .eplb.communicators import plugins
from .eplb.state import Placement
from .gc import GcController
from .kernel import Kernel
from .oracles import Oracles
from .records import XFER_KINDS, fabric_record, xfer_fields
from .worker import Worker

ENGINE_PID = -1  # the engine's simulated thread belongs to no rank: an exception there is epsim's own bug


PREPARE_TIE_S = 1e-9  # far above float rounding at a day's simulated seconds, far below anything modelled


class NominalTimeModel(TimeModel):
    """Transfers take the time of the scenario's *nominal* expert size, not of the tiny rows the simulation moves."""

    def __init__(
        self,
        row_bytes: int,
        nominal_row_bytes: float,
        bandwidth_Bps: float = 40e9,
        latency_s: float = 10e-6,
        connect_s: float = 0.0,
        **host_costs: float,
    ) -> None:
        super().__init__(xfer_latency_s=latency_s, bandwidth_Bps=bandwidth_Bps, connect_s=connect_s, **host_costs)
        object.__setattr__(self, "_scale", nominal_row_bytes / max(1, row_bytes))

    if TYPE_CHECKING:
        _scale: float  # set once above (the time model is a frozen dataclass)

    def wire_seconds(self, nbytes: int) -> float:
        return nbytes * self._scale / self.bandwidth_Bps


class Cluster:
    def __init__(
        self,
        scenario,
        *,
        seed: int,
        strategy: str,
        profile: str,
        faults: Sequence[fault_catalogue.Armed] = (),
        on_progress=None,
        calibration=None,
    ) -> None:
        self.scenario, self.seed, self.strategy, self.profile = scenario, seed, strategy, profile
        self._modules_before = {name for name in sys.modules if plugins.FRESH_MARK in name}
        with fakes.installed():  # a package that imports nixl or deep_ep at top level loads without the real ones
            plugins.load(strategy)  # a missing or broken strategy is a one-line error before anything starts
        self.kernel = Kernel(seed)
        m = scenario.model
        row_bytes = m.hidden * 4
        self.calibration = calibration  # a sim.calibration.Calibration: measured costs (see _retime)
        self._row_bytes, self.nominal_row_bytes = row_bytes, m.nominal_expert_bytes / m.tensors_per_layer
        self._costs: dict[str, float] = {}
        self._costs_for = -1  # the number of live rank processes self._costs are for
        self._command_width = 0  # how many ranks the engine's last command went to (collections run that wide)
        self.fabric = FakeFabric(
            profile,
            clock=self.kernel.now,
            whoami=self._whoami,
            time_model=NominalTimeModel(row_bytes, self.nominal_row_bytes),
        )
        self.fabric.poll_wait = self._poll_wait
        if calibration is not None:
            self.fabric.spend = self.spend
        self.fabric.thread_of = self.kernel.current
        self.oracles = Oracles(self.kernel.history)
        self.fabric.event_listeners.append(self._on_fabric)
        self.fabric.xfer_listeners.append(self._on_xfer)
        self.gc = GcController(self)
        self.faults = fault_catalogue.FaultPlan(list(faults), self.fabric, self.kernel.history)
        # The timeline over this world; on_progress is called with (step, simulated seconds) between events.
        self.timeline = Engine(self, scenario, seed, self.faults, on_progress)
        self._retime()
        self._cache: dict[Any, Any] = {}
        self.streams: dict[int, device.DeviceStream] = {}  # pid -> its simulated CUDA stream (sim/device.py)
        self.recvs_planned = 0  # expert receives the rebalances asked of the code under test (see unjudged())
        self.vllm_moved = False  # vLLM's own rebalance_execute moved experts (not epsim's model of it)

    # -- plumbing for the fakes ---------------------------------------------------------------------------------
    def _whoami(self) -> int:
        th = self.kernel.current()
        return th.pid if th is not None else -1

    def _retime(self) -> None:
        """Charge every calibrated cost at the number of rank processes alive now: on a host with fewer cores than
        busy threads each grows with them (sim/calibration.py).  Without a calibration nothing takes host time."""
        if self.calibration is None:
            return
        live = sum(1 for w in self.timeline.workers.values() if w.alive)
        if live == self._costs_for:
            return
        self._costs_for, c = live, self.calibration.costs(max(live, 1))
        self._costs = c
        self.fabric.time_model = NominalTimeModel(
            self._row_bytes,
            self.nominal_row_bytes,
            bandwidth_Bps=1.0 / c["seconds_per_byte"],
            latency_s=c["xfer_latency_s"],
            connect_s=c["connect_s"],
            post_s=c["post_s"],
            first_agent_s=c["first_agent_s"],
            agent_s=c["agent_s"],
            register_s=c["register_s"],
            first_remote_setup_s=c["first_remote_setup_s"],
            remote_setup_s=c["remote_setup_s"],
        )

    def cost(self, name: str) -> float:
        """A calibrated cost (sim/calibration.py's LOAD_COSTS) at the live rank processes; 0 without a calibration."""
        return self._costs.get(name, 0.0)

    def _collective_cost(self, kind: str) -> float:
        """A collective's cost: an object collective (all_gather_object, broadcast_object_list) pickles and makes
        two collectives, and was measured as one; any other as a small all_reduce, and the wait for a rank set aside
        by the scheduler that a loaded host adds (fitted: sim/calibration.py's stall_s)."""
        if "_object" in kind:
            return self.cost("gather_s")
        return self.cost("collective_s") + self.cost("stall_s")

    def host_copy_s(self, rows: int, row_bytes: float) -> float:
        """Host time of ``rows`` expert row copies of ``row_bytes`` each where expert weights are in host memory (the
        ``dram`` profile: the copies are memcpy on the rank's thread); none on a GPU, where they queue on a stream,
        or without a calibration."""
        if self.profile != "dram" or not rows:
            return 0.0
        return rows * (self.cost("copy_latency_s") + row_bytes * self.cost("copy_seconds_per_byte"))

    def spend(self, seconds: float, why: str) -> None:
        """A calibrated cost's host time, on the simulated thread that incurs it (a fake call's, a collection's, a
        copy's, the engine's posting); nothing when the cost is none or no simulated thread is running."""
        if seconds > 0 and self.kernel.current() is not None:
            self.kernel.sleep(seconds, why)

    def _poll_wait(self, due: float) -> None:
        wait = 1e-3 if math.isinf(due) else min(max(due - self.kernel.now(), 1e-6), 1e-2)
        self.kernel.sleep(wait, "polling a NIXL transfer")

    def _on_fabric(self, kind: str, fields: dict[str, Any]) -> None:
        self.oracles.on_fabric(kind, fields)
        entry = fabric_record(kind, fields)
        if entry is not None:
            self.kernel.history.add(*entry)

    def _on_xfer(self, kind: str, core: Any, req: Any, target: str | None) -> None:
        """A transfer's post or completion (half of all events), read from the fake's request in place."""
        if kind == "xfer.done":
            local, remote = req.spans
            self.oracles.transfer_moved(core.name, core.pid, req.op, req.nbytes, core.conn, local, target, remote)
        self.kernel.history.add(XFER_KINDS[kind], xfer_fields(core.name, core.pid, req.peer, req.op, req.nbytes))

    def _deep_ep(self):
        """``import deep_ep`` gives the fake, with the scenario's NVSHMEM profile (only when an all2all is used)."""
        if self.scenario.all2all.backend == "none":
            return contextlib.nullcontext()
        import fakes.deep_ep

        fakes.deep_ep.configure(self.kernel, self.scenario.all2all.nvshmem)
        return fakes.deep_ep.installed()

    def restart_agents(self, pid: int) -> list[str]:
        """Fault ``peer.restart``: every live agent of ``pid`` restarts in place under its name (on pid's thread)."""
        from fakes.nixl._agent import restart_in_place

        cores = sorted(
            (c for c in list(self.fabric.conns.values()) if c.pid == pid and not c.destroyed), key=lambda c: c.uid
        )
        return [restart_in_place(c).name for c in cores]

    # -- shared pure computations (every rank would compute the same) -------------------------------------------
    def plan(self, old: Placement, new: Placement, layer: int, mapping) -> list:
        key = ("plan", old, new, layer, _frozen(mapping))
        if key not in self._cache:
            self._cache[key] = move.plan_all(old, new, layer, mapping)
        return self._cache[key]

    def indices(self, old: Placement, new: Placement, layer: int, mapping) -> tuple[np.ndarray, np.ndarray]:
        """vLLM's old and new global expert indices of ``layer`` (int64 arrays, as vLLM hands ``old_indices`` to
        ``set_transfer_context``); shared by every rank, so read-only."""
        key = ("idx", old, new, layer, _frozen(mapping))
        if key not in self._cache:
            pair = move.layer_indices(old, new, layer, mapping)
            for a in pair:
                a.flags.writeable = False
            self._cache[key] = pair
        return self._cache[key]

    # -- groups and workers ---------------------------------------------------------------------------------------
    def new_group(self, name: str, members: list[int]) -> torch_dist.Rendezvous:
        # A collective's cost is the calibration's at the live rank processes when it completes.
        latency = self._collective_cost if self.calibration is not None else 0.0
        return torch_dist.Rendezvous(self.kernel, name, members, self.scenario.collective_timeout_s, latency)

    def spawn_worker(self, pid: int, group, rank: int, placement: Placement | None) -> Worker:
        factory = plugins.load(self.strategy)  # a fresh module: module state is per process
        w = Worker(self, pid, factory, placement, group, rank)
        self.timeline.workers[pid] = w
        self._retime()
        w.start()
        return w

    def _command_limit_s(self) -> float:
        """Simulated seconds a command may take: two collective timeouts and a minute."""
        return self.scenario.collective_timeout_s * 2 + 60

    def join(self, pending: dict[int, Any], what: str, busy_s: float = 0.0) -> bool:
        """Wait for every worker's command (pid -> event); a liveness failure naming the laggards otherwise.  A
        rank that was killed never answers, and the engine knows it at once (vLLM's executor watches its worker
        processes; the real backend's parent reads the end of the dead rank's pipe)."""
        limit = busy_s + self._command_limit_s()  # a long serving chunk is no reason to give up on it
        # Only the engine kills a rank, between its commands: a command to a dead rank is known dead when posted.
        dead = [p for p in pending if not self.timeline.workers[p].alive]
        if not dead:
            ok, _ = self.kernel.wait_for(self.kernel.env.all_of(list(pending.values())), limit, what)
            if ok:
                return True
        if dead:
            desc = "; ".join(self._describe(p) for p in dead)
            self.oracles.stuck(f"{what}: pids {dead} were killed and will never answer: {desc}")
        else:
            desc = "; ".join(self._describe(p) for p, ev in pending.items() if not ev.triggered)
            self.oracles.stuck(f"{what} did not finish within {limit:g} s: {desc}")
        self.kernel.halt()
        return False

    def _describe(self, pid: int) -> str:
        threads = [t for t in self.kernel.threads if t.pid == pid and t.state != "done"]

        def where(t) -> str:  # what a thread waits on means something only while it waits
            return f" on {t.blocked_on}" if t.blocked_on and t.state in ("blocked", "killed") else ""

        return f"pid {pid}: " + ", ".join(f"{t.name} {t.state}{where(t)}" for t in threads)

    # -- the World hooks the engine calls ------------------------------------------------------------------------------
    def record(self, kind: str, **fields: Any) -> None:
        self.kernel.history.record(kind, **fields)

    def now(self) -> float:
        return self.kernel.now()

    def prepared(self, handles: dict[int, Any]) -> bool:
        """Whether every rank's PREPARE is done, asked when serving has covered the scenario's ``prepare_s``.

        A simulated PREPARE takes exactly ``prepare_s``, so it ends at the same instant as the chunk of serving that
        covers it; which of the two the kernel ran first was float rounding (``t + 0.5 + 0.5`` against
        ``t + 1.0``) and the tie-break's draw, and a run served a chunk more or less for no reason a real run has
        (where PREPARE is done sooner).  A PREPARE due within ``PREPARE_TIE_S`` counts as done now."""
        pending = [ev.value for ev in handles.values() if not ev.value.triggered]
        if not pending:
            return True
        done, _ = self.kernel.wait_for(self.kernel.env.all_of(pending), PREPARE_TIE_S, "PREPARE due at this instant")
        return done

    def prepare_limit_s(self, prepare_s: float) -> float:
        return prepare_s + self._command_limit_s()

    def prepare_never_finished(self, handles: dict[int, Any], limit: float) -> None:
        desc = "; ".join(self._describe(p) for p, ev in handles.items() if not ev.value.triggered)
        self.oracles.stuck(f"PREPARE did not finish within {limit:g} s while the group served: {desc}")
        self.kernel.halt()

    def fail_rank(self, pid: int) -> None:
        self.timeline.workers[pid].alive = False
        self.end_process(pid, "was killed")

    def end_process(self, pid: int, why: str = "exited") -> None:
        """Process ``pid`` is gone.  Called by the engine only: a thread of ``pid`` itself would stop for good in
        ``kill_process``, before the rest of this ran."""
        self.kernel.kill_process(pid)
        self.fabric.kill_process(pid)
        self.gc.process_gone(pid)
        torch_dist.process_gone(self.kernel, pid, why)  # its sockets closed: its groups' collectives fail at once
        self._retime()

    def rocm(self) -> bool:
        return self.profile == "rocm-strict"  # the fake's ROCm profile (vLLM's code is told it runs on ROCm there)

    def dispatching(self, kind: str, pids: list[int]) -> None:
        self._command_width = len(pids)

    def collect_cost(self) -> float:
        """A planned collection's calibrated cost, at the ranks the last command went to: they collect at once."""
        if self.calibration is None:
            return 0.0
        width = max(1, min(self._command_width or self._costs_for, max(self._costs_for, 1)))
        return self.calibration.costs(width)["collect_s"]

    def dispatch_gap(self) -> None:
        self.spend(self.cost("command_s"), "posting the command to the next rank")

    def before_rebalance(self) -> None:
        self._cache.clear()  # every earlier move has finished (drained): its plans are garbage

    def reconfigured(self, members: list[int]) -> None:
        self.oracles.reconfiguration_complete(members)

    def halt(self) -> None:
        self.kernel.halt()  # pending timers (join timeouts) need not run out

    def exited(self) -> None:
        self.gc.collect("shutdown")

    # -- the run ------------------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        finally:
            # The simulated processes are gone: so are their module instances (their objects stay reachable from
            # this cluster for the oracles and tests, and die with it).
            plugins.forget_instances(self._modules_before)

    def _run(self) -> None:
        with (
            fakes.installed(self.fabric),
            torch_dist.installed(),
            device.installed(self.streams, self.kernel, rocm=self.rocm()),
            self._deep_ep(),
        ):
            self.kernel.spawn("engine", self.timeline.engine, pid=ENGINE_PID)
            self.kernel.run()
        # Interpreter shutdown: what survived (gc.never) is finalized with the fake modules torn down.
        left = self.gc.shutdown()
        if left:
            self.kernel.history.record("interpreter.shutdown", objects=len(left))
            with self.kernel.deterministic():
                del left
        for where, exc in self.kernel.unraisable:
            # A collective that times out inside a finalizer (a DeepEP buffer's destroy run by the collector) is
            # a liveness failure like any other; other finalizer errors stay in the history only.
            if isinstance(exc, torch_dist.CollectiveTimeout):
                index = next(
                    (
                        i
                        for i, (_, kind, f) in enumerate(self.kernel.history.records)
                        if kind == "finalizer.error" and f.get("where") == where
                    ),
                    len(self.kernel.history),
                )
                self.oracles.crashed(f"finalizer {where}", -1, exc, index)
        records = self.kernel.history.records
        for index in records.positions("deep_ep.leak"):  # the fake's destructor records each one as DeepEP warns
            t, _, f = records[index]
            self.oracles.buffer_leaked(f["pid"], f["team"], index, t)
        for th, exc in self.kernel.crashes:
            index = next(
                (
                    i
                    for i, (_, kind, f) in enumerate(self.kernel.history.records)
                    if kind == "thread.crash" and f.get("thread") == th.name
                ),
                len(self.kernel.history),
            )
            self.oracles.crashed(th.name, th.pid, exc, index)
        engine = self.kernel.threads[0] if self.kernel.threads else None
        if not self.kernel.crashes and engine is not None and engine.state != "done" and not self.oracles.problems:
            self.oracles.stuck(f"the engine did not finish: {engine!r}")
        if not self.oracles.problems:
            self.oracles.after_shutdown()

    def unjudged(self) -> str | None:
        """Why the run cannot be judged, if it cannot: experts moved between ranks, their weights came out right,
        and not one transfer went through the fake NIXL.  The code under test then moved them through something
        epsim does not see (a real NIXL bound by a module imported before the fakes were installed), and a
        ``pass`` would judge nothing."""
        if self.recvs_planned == 0 or self.oracles.metrics["transfers"] > 0:
            return None
        if self.oracles.problems:  # not a pass: the verdict names what went wrong (a crash inside the fake, say)
            return None
        return (
            f"the code under test received {self.recvs_planned} experts without one transfer through epsim's "
            f"fake NIXL (did a module of it bind a real NIXL before the fakes were installed?); no verdict"
        )


def _frozen(mapping) -> Any:
    return None if mapping is None else tuple(sorted(mapping.items()))
