"""The deployment: an engine thread that drives simulated workers through a scenario's timeline.

One :class:`Cluster` is one run: its own kernel, fake-NIXL fabric, process groups, workers, GC controller, fault
plan and oracles.  The engine serves forward steps in chunks (steady serving needs no event per step), rebalances
every ``step_interval`` steps, runs elastic events as vLLM does (PREPARE in the background while serving, then
COMMIT; scale-down rebalances through the old group first), then heals every fault, rebalances once more to show
convergence, and shuts down.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

import fakes
from fakes import torch_dist
from fakes.nixl import FakeFabric, TimeModel

from . import faults as fault_catalogue
from .eplb import move, policy
from .eplb.communicators import plugins
from .eplb.state import ModelShape, Placement
from .gc import GcController
from .kernel import Kernel
from .oracles import Oracles
from .rng import derive_seed
from .worker import Command, Worker


class NominalTimeModel(TimeModel):
    """Transfers take the time of the scenario's *nominal* expert size, not of the tiny rows the simulation moves."""

    def __init__(self, row_bytes: int, nominal_row_bytes: float, bandwidth_Bps: float = 40e9,
                 latency_s: float = 10e-6) -> None:
        super().__init__(xfer_latency_s=latency_s, bandwidth_Bps=bandwidth_Bps)
        object.__setattr__(self, "_scale", nominal_row_bytes / max(1, row_bytes))

    def xfer_seconds(self, nbytes: int) -> float:
        return self.xfer_latency_s + nbytes * self._scale / self.bandwidth_Bps


PREPARE_POLL_STEPS = 10  # serving goes on in chunks of this many steps while PREPARE runs in the background
_HISTORY_FIELDS = ("agent", "pid", "peer", "op", "nbytes", "why", "sections")
_XFER_KINDS = {"xfer.post": "nixl.xfer.post", "xfer.done": "nixl.xfer.done"}


class Cluster:
    def __init__(self, scenario, *, seed: int, strategy: str, profile: str,
                 faults: list[fault_catalogue.Armed] = (), on_progress=None) -> None:
        self.scenario, self.seed, self.strategy, self.profile = scenario, seed, strategy, profile
        self.on_progress = on_progress  # called with (step, simulated seconds) between lifecycle events
        self._modules_before = {name for name in sys.modules if plugins.FRESH_MARK in name}
        plugins.load(strategy)  # a missing or broken strategy is a one-line error before anything starts
        self.kernel = Kernel(seed)
        m = scenario.model
        self.shape = ModelShape(m.layers, m.experts, m.local_experts, m.hidden)
        row_bytes = m.hidden * 4
        time_model = NominalTimeModel(row_bytes, m.nominal_expert_bytes / m.tensors_per_layer)
        self.fabric = FakeFabric(profile, clock=self.kernel.now, whoami=self._whoami, time_model=time_model)
        self.fabric.poll_wait = self._poll_wait
        self.fabric.thread_of = self.kernel.current
        self.oracles = Oracles(self)
        self.fabric.listeners.append(self._on_fabric)
        self.gc = GcController(self)
        self.faults = fault_catalogue.FaultPlan(list(faults), self.fabric, self.kernel.history)
        self.workers: dict[int, Worker] = {}
        self.members: list[int] = []
        self.placement: Placement | None = None
        self.generation = 0
        self.step = 0
        self.rdv: torch_dist.Rendezvous | None = None  # the current EP/EPLB group
        self._next_pid = 0
        self._cache: dict[Any, Any] = {}
        self._routing = np.random.Generator(np.random.PCG64(derive_seed(seed, "routing")))
        self._route_epoch = -1
        self._route_probs: np.ndarray | None = None

    # -- plumbing for the fakes ---------------------------------------------------------------------------------
    def _whoami(self) -> int:
        th = self.kernel.current()
        return th.pid if th is not None else -1

    def _poll_wait(self, due: float) -> None:
        wait = 1e-3 if math.isinf(due) else min(max(due - self.kernel.now(), 1e-6), 1e-2)
        self.kernel.sleep(wait, "polling a NIXL transfer")

    def _on_fabric(self, kind: str, fields: dict[str, Any]) -> None:
        self.oracles.on_fabric(kind, fields)
        if kind in ("memory.free",):
            return
        name = _XFER_KINDS.get(kind)
        if name is not None:  # half the events of a run: their fields are known
            self.kernel.history.record(name, agent=fields["agent"], pid=fields["pid"], peer=fields["peer"],
                                       op=fields["op"], nbytes=fields["nbytes"])
            return
        plain = {k: fields[k] for k in _HISTORY_FIELDS if k in fields}
        if "ranges" in fields:
            plain["regions"] = len(fields["ranges"])
        self.kernel.history.record(f"nixl.{kind}", **plain)

    def restart_agents(self, pid: int) -> list[str]:
        """Fault ``peer.restart``: every live agent of ``pid`` restarts in place under its name (on pid's thread)."""
        from fakes.nixl._agent import restart_in_place

        cores = sorted((c for c in list(self.fabric.conns.values()) if c.pid == pid and not c.destroyed),
                       key=lambda c: c.uid)
        return [restart_in_place(c).name for c in cores]

    # -- shared pure computations (every rank would compute the same) -------------------------------------------
    def plan(self, old: Placement, new: Placement, layer: int, mapping) -> list:
        key = ("plan", old, new, layer, _frozen(mapping))
        if key not in self._cache:
            self._cache[key] = move.plan_all(old, new, layer, mapping)
        return self._cache[key]

    def indices(self, old: Placement, new: Placement, layer: int, mapping) -> tuple[list[int], list[int]]:
        key = ("idx", old, new, layer, _frozen(mapping))
        if key not in self._cache:
            o, n = move.layer_indices(old, new, layer, mapping)
            self._cache[key] = (o.tolist(), n.tolist())
        return self._cache[key]

    # -- groups and workers ---------------------------------------------------------------------------------------
    def new_group(self, members: list[int]) -> torch_dist.Rendezvous:
        rdv = torch_dist.Rendezvous(self.kernel, f"eplb#{self.generation}", members,
                                    self.scenario.collective_timeout_s)
        self.generation += 1
        return rdv

    def spawn_worker(self, group, rank: int, placement: Placement | None) -> Worker:
        pid = self._next_pid
        self._next_pid += 1
        factory = plugins.load(self.strategy)  # a fresh module: module state is per process
        w = Worker(self, pid, factory, placement, group, rank)
        self.workers[pid] = w
        w.start()
        return w

    def _join(self, pending: dict[int, Any], what: str) -> bool:
        """Wait for every worker's command (pid -> event); a liveness failure naming the laggards otherwise."""
        limit = self.scenario.collective_timeout_s * 2 + 60
        ok, _ = self.kernel.wait_for(self.kernel.env.all_of(list(pending.values())), limit, what)
        if not ok:
            late = [p for p, ev in pending.items() if not ev.triggered]
            desc = "; ".join(self._describe(p) for p in late)
            self.oracles.stuck(f"{what} did not finish within {limit:g} s: {desc}")
            self.kernel.halt()
        return ok

    def _describe(self, pid: int) -> str:
        threads = [t for t in self.kernel.threads if t.pid == pid and t.state != "done"]

        def where(t) -> str:  # what a thread waits on means something only while it waits
            return f" on {t.blocked_on}" if t.blocked_on and t.state in ("blocked", "killed") else ""

        return f"pid {pid}: " + ", ".join(f"{t.name} {t.state}{where(t)}" for t in threads)

    def _all(self, kind: str, pids: list[int] | None = None, **args: Any) -> bool:
        pids = self.members if pids is None else pids
        return self._join({p: self.workers[p].post(Command(kind, dict(args))) for p in pids}, f"{kind} on {pids}")

    # -- the engine -----------------------------------------------------------------------------------------------
    def engine(self) -> None:
        sc = self.scenario
        rdv = self.rdv = self.new_group(list(range(sc.ranks)))
        self.placement = Placement.initial(self.shape, sc.ranks)
        groups = rdv.groups()
        for r in range(sc.ranks):
            self.spawn_worker(groups[r], r, self.placement)
        self.members = list(range(sc.ranks))
        self._set_members(rdv)
        if not self._all("start"):
            return
        events = list(sc.timeline)
        next_rebalance = sc.eplb.first_rebalance_step
        while self.step < sc.steps:
            if self.on_progress is not None:
                self.on_progress(self.step, self.kernel.now())
            self.faults.at_step(self.step)
            if events and events[0].at_step <= self.step:
                if not self.elastic(events.pop(0)):
                    return
                continue
            if self.step >= next_rebalance:
                if not self.rebalance():
                    return
                next_rebalance += sc.eplb.step_interval
                continue
            stop = min(sc.steps, next_rebalance, events[0].at_step if events else sc.steps,
                       self.faults.next_step(self.step))  # a fault is armed at its step, not at the chunk's end
            if not self.serve(stop - self.step):
                return
        self.faults.heal()
        if self.rebalance():
            self.shutdown()
        self.kernel.halt()  # pending timers (join timeouts) need not run out

    def _set_members(self, rdv) -> None:
        self.kernel.history.record("engine.members", group=rdv.name, members=list(rdv.pids))

    def serve(self, steps: int) -> bool:
        sc = self.scenario
        drift = sc.serving.drift_every_steps
        while steps > 0:
            chunk = steps
            if drift:
                chunk = min(chunk, drift - self.step % drift)
            epoch = self.step // drift if drift else 0
            probs = self._probs(epoch)
            loads = self._route(chunk, probs)
            self.kernel.history.record("engine.serve", step=self.step, steps=chunk)
            if not self._join({p: self.workers[p].post(Command("serve", {"steps": chunk, "loads": loads[i]}))
                               for i, p in enumerate(self.members)}, f"serving steps {self.step}..{self.step + chunk}"):
                return False
            self.step += chunk
            steps -= chunk
        return True

    def _route(self, steps: int, probs: np.ndarray) -> list[np.ndarray]:
        """Expert load of ``steps`` forward steps, per member: a (layers, experts) token count each.

        The group's tokens are routed in one exact multinomial draw per layer, then dealt out evenly, the
        remainder (under one token per member and expert) to one member in turn; so the all-reduced load is an
        exact sample of the routing distribution.  DP ranks see statistically identical traffic, and per-rank draws
        would cost a multinomial per rank per layer per chunk (about 1 M binomials per chunk at EP64).  Members
        only read their arrays, so the even share is one array for all of them.
        """
        sc = self.scenario
        n = len(self.members)
        draws = steps * sc.serving.tokens_per_step * sc.serving.top_k * n
        total = self._routing.multinomial(draws, probs)  # (layers, experts)
        share, rest = np.divmod(total, n)
        share.flags.writeable = False
        loads = [share] * n
        loads[self.step % n] = share + rest
        return loads

    def _probs(self, epoch: int) -> np.ndarray:
        if epoch != self._route_epoch:
            m, skew = self.scenario.model, self.scenario.serving.skew
            rng = np.random.Generator(np.random.PCG64(derive_seed(self.seed, f"routing-epoch-{epoch}")))
            ranks = np.arange(1, m.experts + 1, dtype=np.float64)
            base = ranks ** -skew
            self._route_probs = np.stack([rng.permutation(base) / base.sum() for _ in range(m.layers)])
            self._route_epoch = epoch
        return self._route_probs

    def total_load(self, pids: list[int]) -> np.ndarray:
        total = np.zeros((self.scenario.model.layers, self.scenario.model.experts), dtype=np.int64)
        for p in pids:
            total += self.workers[p].load.total()
        return total

    def rebalance(self, new_size: int | None = None, mapping: dict[int, int] | None = None) -> bool:
        """EPLB rearrange over the current members (a scale-down passes the smaller size and the rank mapping)."""
        old = self.placement
        size = new_size or len(self.members)
        self._cache.clear()  # every earlier move has finished (drained): its plans are garbage
        new = policy.rebalance(self.total_load(self.members), self.shape, size)
        if size == old.ep_size and new == old:
            new = old
        self.kernel.history.record("engine.rebalance", step=self.step, ep_size=size)
        ok = self._all("rearrange", old=old, new=new, mapping=mapping)
        if ok and self.scenario.eplb.use_async:
            ok = self._all("drain")
        self.placement = new
        return ok

    def elastic(self, event) -> bool:
        self.kernel.history.record(f"engine.{event.kind}", step=self.step, to=event.to, rank=event.rank)
        if event.kind == "fail_rank":
            pid = self.members[event.rank]
            self.kernel.kill_process(pid)
            self.fabric.kill_process(pid)
            self.workers[pid].alive = False
            return True  # vLLM has no rank-failure recovery yet (#46370): the others find out the hard way
        old_members = list(self.members)
        size = event.to
        if size > len(old_members):
            new_members = old_members + [self._next_pid + i for i in range(size - len(old_members))]
        else:
            new_members = old_members[:size]
        rdv = self.new_group(new_members)
        groups = rdv.groups()
        fresh = [self.spawn_worker(groups[r], r, None) for r in range(len(old_members), size)]
        joined = {w.pid: w.post(Command("start")) for w in fresh}
        prepared = {p: self.workers[p].post(Command("prepare", {"group": groups[new_members.index(p)],
                                                                "prepare_s": event.prepare_s}))
                    for p in old_members if p in new_members}
        if not self._join({**joined, **prepared}, "PREPARE"):
            return False
        # PREPARE runs in the background while serving goes on; wait for every rank's standby communicator.
        done = [ev.value for ev in prepared.values()]
        while not all(ev.triggered for ev in done):
            if not self.serve(PREPARE_POLL_STEPS):
                return False
        if event.kind == "abort":
            if not self._all("abort", [p for p in old_members if p in new_members]):
                return False
            return self._retire([w.pid for w in fresh], rdv)
        if size > len(old_members):  # scale-up: commit, then reshuffle on the new group
            if not self._all("commit", [p for p in old_members]):
                return False
            self._retire([], self.rdv)
            self.rdv, self.members = rdv, new_members
            self._set_members(rdv)
            ok = self.rebalance(mapping={r: r for r in range(len(old_members))})
        else:  # scale-down: rebalance through the old group first, then the survivors commit and the rest leave
            mapping = {r: (r if r < size else -1) for r in range(len(old_members))}
            if not self.rebalance(new_size=size, mapping=mapping):
                return False
            if not self._all("commit", new_members):
                return False
            old_rdv, self.rdv, self.members = self.rdv, rdv, new_members
            self._set_members(rdv)
            ok = self._retire([p for p in old_members if p not in new_members], old_rdv)
        if ok:
            self.oracles.reconfiguration_complete(self.members)
        return ok

    def _retire(self, pids: list[int], rdv) -> bool:
        ok = self._all("exit", pids) if pids else True
        for pid in pids:
            self.kernel.kill_process(pid)  # the process is gone; anything its threads still held goes with it
            self.fabric.kill_process(pid)
        if rdv is not None:
            rdv.destroyed = True
        return ok

    def shutdown(self) -> None:
        self.kernel.history.record("engine.shutdown", step=self.step)
        live = [p for p in self.members if self.workers[p].alive]
        self._all("exit", live)
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
        with fakes.installed(self.fabric), torch_dist.installed():
            self.kernel.spawn("engine", self.engine, pid=-1)
            self.kernel.run()
        # Interpreter shutdown: what survived (gc.never) is finalized with the fake modules torn down.
        left = self.gc.shutdown()
        if left:
            self.kernel.history.record("interpreter.shutdown", objects=len(left))
            with self.kernel.deterministic():
                del left
        for th, exc in self.kernel.crashes:
            index = next((i for i, (_, kind, f) in enumerate(self.kernel.history.records)
                          if kind == "thread.crash" and f.get("thread") == th.name), len(self.kernel.history))
            self.oracles.crashed(th.name, th.pid, exc, index)
        engine = self.kernel.threads[0] if self.kernel.threads else None
        if not self.kernel.crashes and engine is not None and engine.state != "done" and not self.oracles.problems:
            self.oracles.stuck(f"the engine did not finish: {engine!r}")
        if not self.oracles.problems:
            self.oracles.after_shutdown()


def _frozen(mapping) -> Any:
    return None if mapping is None else tuple(sorted(mapping.items()))
