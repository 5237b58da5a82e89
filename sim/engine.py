"""The engine: a scenario's timeline as vLLM's engine drives its workers, for every world epsim runs in.

Serving in chunks (steady serving needs no event per step), an EPLB rebalance every ``step_interval`` steps, elastic
events as vLLM runs them (PREPARE in the background while serving goes on, then COMMIT; a scale-down rebalances
through the old group first), then healing, one more rebalance to show convergence, and shutdown.

The timeline is the same whether the workers are simulated (:class:`sim.cluster.Cluster`, greenlets in simulated
time) or real processes (:class:`real_backends.cluster.RealCluster`, wall clock); each world makes an
:class:`Engine` over itself and supplies the :class:`World` hooks: how to record an event, start a worker, post it a
command and wait for commands.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from .eplb import policy
from .eplb.state import ModelShape, Placement
from .rng import derive_seed
from .command import Command

PREPARE_POLL_STEPS = 10  # serving goes on in chunks of this many steps while PREPARE runs in the background


def routed_shares(weights: np.ndarray, top_k: int) -> np.ndarray:
    """Each expert's share of the routed token-slots when every token picks ``top_k`` distinct experts with
    popularity ``weights``: at most ``1 / top_k`` (an expert is in a token's top-k at most once), the rest in
    proportion to ``weights`` (inclusion probabilities ``min(1, c * w)`` summing to ``top_k``).  Without the cap a
    Zipf 1.2 popularity over 256 experts would give the hottest expert 25% of the slots, twice what top-8 allows."""
    w = np.asarray(weights, dtype=np.float64)
    share = w / w.sum()
    capped = np.zeros(w.shape, dtype=bool)
    while True:
        over = ~capped & (share > 1.0 / top_k)
        if not over.any():
            return share
        capped |= over
        rest = w[~capped]
        share = np.where(capped, 1.0 / top_k, 0.0)
        if rest.size:  # the capped experts' excess goes to the others in proportion to their weights
            share[~capped] = rest / rest.sum() * (1.0 - capped.sum() / top_k)


class World(Protocol):
    """What a world supplies to the :class:`Engine` that drives it: how to record an event and read its clock, make
    a group and start a worker, wait for commands, and the points where it acts on the timeline.  Its workers have
    ``.pid``, ``.alive``, ``.load`` and ``.post(Command)``, which returns a handle that :meth:`join` waits for."""

    def record(self, kind: str, **fields: Any) -> None: ...

    def now(self) -> float: ...

    def new_group(self, name: str, members: list[int]) -> Any:
        """A group ``name`` over pids ``members``: ``.name``, ``.pids``, ``.groups()`` (one per member rank),
        ``.destroyed``."""

    def spawn_worker(self, pid: int, group, rank: int, placement: Placement | None) -> Any:
        """Start worker ``pid`` (rank ``rank`` of ``group``) and put it in the engine's ``workers`` table."""

    def join(self, pending: dict[int, Any], what: str, busy_s: float = 0.0) -> bool:
        """Wait for every worker's command (pid -> handle); False (and a liveness problem) if some never finish.
        ``busy_s``: how long the command itself takes (serving steps), on top of the limit."""

    def prepared(self, handles: dict[int, Any]) -> bool:
        """Whether every PREPARE posted (pid -> handle of the prepare command) has built its communicator."""

    def prepare_limit_s(self, prepare_s: float) -> float:
        """How long serving waits for a PREPARE that takes ``prepare_s`` before the run is a liveness failure (the
        world's clock)."""

    def prepare_never_finished(self, handles: dict[int, Any], limit: float) -> None:
        """Record the liveness failure of a PREPARE still running after ``limit`` (pid -> handle)."""

    def fail_rank(self, pid: int) -> None: ...

    def end_process(self, pid: int) -> None:
        """A worker that exited is gone for good."""

    def rocm(self) -> bool:
        """Whether the ranks' platform is ROCm (vLLM's ``current_platform.is_rocm()``)."""

    def dispatching(self, kind: str, pids: list[int]) -> None:
        """A command is about to go to ``pids`` (a cost model may depend on how many ranks run it at once)."""

    def dispatch_gap(self) -> None:
        """Between posting one command to two ranks in turn: a real parent's sends take time of their own (they pass
        by themselves); the simulation's take what a calibration measured."""

    def before_rebalance(self) -> None:
        """A rebalance starts: every earlier move has finished (drained)."""

    def reconfigured(self, members: list[int]) -> None:
        """An elastic reconfiguration completed with ``members``."""

    def exited(self) -> None:
        """Every live worker has exited (the world may collect what they left)."""

    def halt(self) -> None:
        """The timeline is over."""


class Engine:
    """A run's timeline, driving ``world`` (:class:`World`): its scenario, routing seed, fault plan and an optional
    ``on_progress(step, now)``, called between lifecycle events."""

    def __init__(self, world: World, scenario: Any, seed: int, faults: Any, on_progress: Any = None) -> None:
        self.world, self.scenario, self.seed, self.faults, self.on_progress = world, scenario, seed, faults, on_progress
        m = scenario.model
        self.shape = ModelShape(m.layers, m.experts, m.local_experts, m.hidden, m.expert_groups)
        self.workers: dict[int, Any] = {}  # pid -> worker, filled by the world's spawn_worker
        self.members: list[int] = []
        self.placement: Placement | None = None
        self.generation = 0
        self.step = 0
        self.rdv: Any = None  # the current EP/EPLB group
        self._next_pid = 0
        self._routing = np.random.Generator(np.random.PCG64(derive_seed(seed, "routing")))
        self._route_epoch = -1
        self._route_probs = np.empty((0, 0))  # the epoch's routing probabilities, made at its first step
        # The load the last rebalance placed experts for (vLLM's last_expert_load, ones before the first): the
        # reshuffle of an elastic reconfiguration places for it, not for the current window.
        self._last_load = np.ones((m.layers, m.experts), dtype=np.int64)
        self._window_reads: list[int] = []  # steps at which a rebalance will read the load window (serve() splits)
        # (what, start, end) of every rebalance and reconfiguration in the world's time; not in the history, so a
        # calibration can compare worlds without changing any trace.
        self.spans: list[tuple[str, float, float]] = []

    def _new_group(self, members: list[int]) -> Any:
        group = self.world.new_group(f"eplb#{self.generation}", members)
        self.generation += 1
        return group

    def _spawn(self, group, rank: int, placement: Placement | None) -> Any:
        pid = self._next_pid
        self._next_pid += 1
        return self.world.spawn_worker(pid, group, rank, placement)

    def _all(self, kind: str, pids: list[int] | None = None, **args: Any) -> bool:
        pids = self.members if pids is None else pids
        return self._each({p: kind for p in pids}, **args)

    def _each(self, kinds: dict[int, str], **args: Any) -> bool:
        """Post each rank its command (pid -> kind, in that order) and wait for all of them."""
        pids = list(kinds)
        self.world.dispatching("+".join(dict.fromkeys(kinds.values())), pids)
        handles = {}
        for i, p in enumerate(pids):
            if i:
                self.world.dispatch_gap()
            handles[p] = self.workers[p].post(Command(kinds[p], dict(args)))
        what = " and ".join(f"{k} on {[p for p in pids if kinds[p] == k]}" for k in dict.fromkeys(kinds.values()))
        return self.world.join(handles, what)

    # -- the timeline -------------------------------------------------------------------------------------------
    def engine(self) -> None:
        sc = self.scenario
        rdv = self.rdv = self._new_group(list(range(sc.ranks)))
        self.placement = Placement.initial(self.shape, sc.ranks)
        groups = rdv.groups()
        for r in range(sc.ranks):
            self._spawn(groups[r], r, self.placement)
        self.members = list(range(sc.ranks))
        self._set_members(rdv)
        self.faults.at_step(self.step)  # a fault armed from the start is there for the first registrations too
        if not self._all("start"):
            return
        events = list(sc.timeline)
        next_rebalance = sc.eplb.first_rebalance_step
        while self.step < sc.steps:
            if self.on_progress is not None:
                self.on_progress(self.step, self.world.now())
            if events and events[0].at_step <= self.step:
                event = events.pop(0)
                if not self.elastic(event):
                    return
                if event.kind in ("scale_up", "scale_down"):
                    # vLLM resets expert_rearrangement_step after the reshuffle, so that all ranks count alike.
                    next_rebalance = self.step + sc.eplb.step_interval
                continue
            # The load window covers exactly the last `window` steps at a periodic rebalance and the last one, as
            # vLLM's per-step ring buffer does: serving splits its chunk where that window starts.  An elastic
            # reshuffle's window starts at its event's step minus the window and also holds the PREPARE's steps.
            self._window_reads = [next_rebalance, sc.steps] + [
                e.at_step for e in events[:1] if e.kind in ("scale_up", "scale_down")
            ]
            if self.step >= next_rebalance:
                # Async EPLB moves the layers while serving goes on (vLLM's EplbState.step, one layer per forward
                # step); a rebalance due while one is in flight waits for it (0.33.0) or drains it (pr-53947).
                if not self.rebalance(drain=False):
                    return
                next_rebalance += sc.eplb.step_interval
                continue
            stop = min(sc.steps, next_rebalance, events[0].at_step if events else sc.steps)
            if not self.serve(stop - self.step):  # (which arms each fault at its step)
                return
        self.faults.heal()
        if self.rebalance():
            self.shutdown()
        self.world.halt()

    def _set_members(self, rdv) -> None:
        self.world.record("engine.members", group=rdv.name, members=list(rdv.pids))

    def serve(self, steps: int) -> bool:
        sc = self.scenario
        drift = sc.serving.drift_every_steps
        while steps > 0:
            chunk = steps
            if drift:
                chunk = min(chunk, drift - self.step % drift)
            # A NIXL fault is armed at its step, also while an elastic event serves in short chunks.
            chunk = min(chunk, self.faults.next_step(self.step) - self.step)
            for read in self._window_reads:
                if self.step < read - sc.eplb.window < self.step + chunk:
                    chunk = read - sc.eplb.window - self.step
            epoch = self.step // drift if drift else 0
            probs = self._probs(epoch)
            loads = self._route(chunk, probs)
            self.world.record("engine.serve", step=self.step, steps=chunk)
            if not self.world.join(
                {
                    p: self.workers[p].post(Command("serve", {"steps": chunk, "loads": loads[i]}))
                    for i, p in enumerate(self.members)
                },
                f"serving steps {self.step}..{self.step + chunk}",
                busy_s=chunk * sc.serving.step_time_s,
            ):
                return False
            self.step += chunk
            steps -= chunk
            self.faults.at_step(self.step)  # faults due at this step apply to what comes next (a commit, PREPARE)
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
            base = routed_shares(ranks**-skew, self.scenario.serving.top_k)
            self._route_probs = np.stack([rng.permutation(base) for _ in range(m.layers)])
            self._route_epoch = epoch
        return self._route_probs

    def total_load(self, pids: list[int]) -> np.ndarray:
        total = np.zeros((self.scenario.model.layers, self.scenario.model.experts), dtype=np.int64)
        for p in pids:
            total += self.workers[p].load.total()
        return total

    def rebalance(
        self,
        new_size: int | None = None,
        mapping: dict[int, int] | None = None,
        drain: bool = True,
        asynchronous: bool = True,
        label: str = "rebalance",
    ) -> bool:
        """EPLB rearrange over the current members (a scale-down passes the smaller size and the rank mapping).
        With async EPLB on, the layers move on each rank's async thread unless ``asynchronous`` is False (vLLM
        forces a scale-down's reshuffle synchronous); ``drain``: wait for every rank's layers before going on, as
        the last rebalance does; a periodic one and the reshuffle after a scale-up return at once and the layers
        move while the group serves.  ``label``: the span it adds (an elastic event's reshuffle is a phase of it)."""
        old = self.placement
        assert old is not None, "rebalance before load"
        size = new_size or len(self.members)
        self.world.before_rebalance()
        # vLLM counts the nodes of the ranks the placement is for (a scale-down: the survivors); ranks fill nodes
        # in order.
        nodes = -(-size // self.scenario.gpus_per_node)
        # vLLM's _perform_eplb_reshuffle (both directions) asks for use_last_expert_load; a periodic rebalance reads
        # the window.
        load = self._last_load if mapping is not None else self.total_load(self.members)
        self._last_load = load
        new = policy.rebalance(load, self.shape, size, previous=old, num_nodes=nodes)
        if size == old.ep_size and new == old:
            new = old
        use_async = asynchronous and self.scenario.eplb.use_async
        # vLLM 0.33.0 on ROCm: a synchronous periodic rebalance that gains under 5% moves nothing (the load is still
        # all-reduced first); the communicator is not called.
        skip = (
            self.world.rocm()
            and not use_async
            and mapping is None
            and new is not old
            and bool((old.physical_to_logical >= 0).all())
            and not policy.gains_enough(load, old, new)
        )
        if skip:
            new = old
        self.world.record(
            "engine.rebalance",
            step=self.step,
            ep_size=size,
            placement=new.digest(),
            **({"skipped": True} if skip else {}),
        )
        start = self.world.now()
        ok = self._all("rearrange", old=old, new=new, mapping=mapping, use_async=use_async, skip=skip)
        if ok and drain and use_async:
            ok = self._all("drain")
        self.placement = new
        if ok:
            self.spans.append((label, start, self.world.now()))
        return ok

    def _phase(self, event, phase: str, start: float) -> float:
        """A phase of an elastic event ended now: its span (``scale_up.prepare``, ...); returns now, the next
        phase's start.  The same spans come from the real backend, measured (``epsim calibrate`` compares them)."""
        now = self.world.now()
        self.spans.append((f"{event.kind}.{phase}", start, now))
        return now

    def elastic(self, event) -> bool:
        start = self.world.now()
        ok = self._elastic(event)
        if ok and event.kind != "fail_rank":
            self.spans.append((event.kind, start, self.world.now()))
        return ok

    def _elastic(self, event) -> bool:
        self.world.record(f"engine.{event.kind}", step=self.step, to=event.to, rank=event.rank)
        if event.kind == "fail_rank":
            self.world.fail_rank(self.members[event.rank])
            return True  # vLLM has no rank-failure recovery yet (#46370): the others find out the hard way
        began = self.world.now()
        old_members = list(self.members)
        size = event.to
        if size > len(old_members):
            new_members = old_members + [self._next_pid + i for i in range(size - len(old_members))]
        else:
            new_members = old_members[:size]
        rdv = self._new_group(new_members)
        groups = rdv.groups()
        fresh = [self._spawn(groups[r], r, None) for r in range(len(old_members), size)]
        # A joining rank builds its first communicator in the background too, as its PREPARE (vLLM: PRE_KV_INIT,
        # then PREPARE on the ElasticEPAsync thread), while the old group serves: a communicator that gathers its
        # peers' agents in the constructor (vLLM 0.33.0) is done only once the old ranks' PREPAREs build theirs.
        joined = {w.pid: w.post(Command("start", {"standby": True})) for w in fresh}
        # The step at which PREPARE's window of serving ends and the new communicator is built: the PREPARE's
        # worker faults (storage.move, peer.restart) are decided for that step in both worlds (the simulated
        # PREPARE builds then; the real parent decides them now, and its ranks build at once).
        least = self.step + int(np.ceil(event.prepare_s / self.scenario.serving.step_time_s - 1e-9))
        prepared = {
            p: self.workers[p].post(
                Command(
                    "prepare",
                    {"group": groups[new_members.index(p)], "prepare_s": event.prepare_s, "build_step": least},
                )
            )
            for p in old_members
            if p in new_members
        }
        if not self.world.join({**joined, **prepared}, "PREPARE"):
            return False
        # PREPARE runs in the background while serving goes on; wait for every rank's standby communicator, as
        # long as a command may take: a PREPARE that never returns is a liveness failure, not an endless run.
        # Serving goes on for at least the scenario's prepare_s in every world, so that a real PREPARE that is
        # done sooner (or was done while new ranks started) serves the steps the simulated one does.
        building = {**joined, **prepared}
        start, limit = self.world.now(), self.world.prepare_limit_s(event.prepare_s)
        while self.step < least or not self.world.prepared(building):
            if self.world.now() - start > limit:
                self.world.prepare_never_finished(building, limit)
                return False
            if not self.serve(PREPARE_POLL_STEPS):
                return False
        phase = self._phase(event, "prepare", began)
        if event.kind == "abort":
            # Every member drains what async EPLB has in flight first: the abort reaches only the ranks that were
            # to stay, and a rank's staged layer is taken by its own main thread, so a member left out (one a
            # scale-down would have removed) would hold its async thread, and with it everyone's next collective.
            if self.scenario.eplb.use_async and not self._all("drain"):
                return False
            if not self._all("abort", [p for p in old_members if p in new_members]):
                return False
            phase = self._phase(event, "abort", phase)
            ok = self._retire([w.pid for w in fresh], rdv)
            if ok:  # an abort completes the reconfiguration too: the ranks that were to join are gone
                self._phase(event, "exit", phase)
                self.world.reconfigured(self.members)
            return ok
        # vLLM 0.33.0 drains async EPLB over the old EP group before the scale-up's commit (broadcast_expert_mapping)
        # and before the scale-down's reshuffle (perform_scale_down_eplb_reshuffle): a collective of every old rank.
        if self.scenario.lifecycle == "0.33.0" and self.scenario.eplb.use_async:
            if not self._all("drain", old_members):
                return False
            phase = self._phase(event, "drain", phase)
        reshuffle = f"{event.kind}.reshuffle"
        if size > len(old_members):  # scale-up: commit, then reshuffle on the new group
            if not self._all("commit", [p for p in old_members]):
                return False
            self._retire([], self.rdv)
            self.rdv, self.members = rdv, new_members
            self._set_members(rdv)
            self._phase(event, "commit", phase)
            # vLLM schedules the reshuffle and resumes serving: under async EPLB the layers reach the new ranks one
            # per forward step (a new rank's slots take no tokens until its layer lands); what is still in flight
            # when the next reconfiguration or rebalance comes is drained or waited for as the revision does.
            ok = self.rebalance(mapping={r: r for r in range(len(old_members))}, drain=False, label=reshuffle)
        else:  # scale-down: rebalance through the old group first, then the survivors commit and the rest leave
            mapping = {r: (r if r < size else -1) for r in range(len(old_members))}
            if not self.rebalance(new_size=size, mapping=mapping, asynchronous=False, label=reshuffle):
                return False
            phase = self.world.now()
            leaving = [p for p in old_members if p not in new_members]
            # vLLM 0.33.0's leaving engines run commit_scale_down(removing=True) as soon as they are prepared: after
            # the reshuffle, switch_and_remove destroys their retired groups (all2all buffers among them) alongside
            # the survivors' COMMIT, not once it is done.  They exit after it.
            removing = {p: "remove" for p in leaving} if self.scenario.lifecycle == "0.33.0" else {}
            if not self._each({**{p: "commit" for p in new_members}, **removing}):
                return False
            old_rdv, self.rdv, self.members = self.rdv, rdv, new_members
            self._set_members(rdv)
            phase = self._phase(event, "commit", phase)
            ok = self._retire(leaving, old_rdv)
            if ok:
                self._phase(event, "exit", phase)
        if ok:
            self.world.reconfigured(self.members)
        return ok

    def _retire(self, pids: list[int], rdv) -> bool:
        ok = self._all("exit", pids) if pids else True
        for pid in pids:
            self.world.end_process(pid)  # the process is gone; anything its threads still held goes with it
        if rdv is not None:
            rdv.destroyed = True
        return ok

    def shutdown(self) -> None:
        self.world.record("engine.shutdown", step=self.step)
        live = [p for p in self.members if self.workers[p].alive]
        self._all("exit", live)
        self.world.exited()
