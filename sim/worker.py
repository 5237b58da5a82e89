"""One simulated vLLM worker process: it serves forward steps, records expert load, rebalances experts through its
EPLB communicator, and takes part in elastic reconfiguration (prepare in the background, commit, abort, exit).

The worker's main thread takes commands from the engine (:mod:`sim.cluster`) one at a time, the way vLLM's engine
drives its workers.  PREPARE and the async EPLB move run on threads of their own, as in vLLM ("ElasticEPAsync",
the async EPLB daemon).  The communicator is the code under test; everything else here is the harness around it.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fakes.torch_dist import FakeProcessGroup

from .command import Command
from .device import DeviceStream
from .eplb import move
from .eplb.state import LoadWindow, Placement, check_weights, fill_weights
from .faults import WORKER_SITES
from .rng import derive_seed
from .vllm import move_loop as vllm_move_loop


def _ep_group_of(group: FakeProcessGroup) -> FakeProcessGroup:
    """This rank's handle on the EP group of ``group``'s generation: the ``ep`` sibling of the EPLB group, over the
    same members (vLLM's readiness all_reduce and the DeepEP buffer run there, the communicator on the EPLB group)."""
    return FakeProcessGroup(group.rendezvous.sibling("ep"), group.rank())


class Worker:
    def __init__(self, cluster, pid: int, factory, placement: Placement | None, group, group_rank: int) -> None:
        self.cluster, self.kernel, self.pid = cluster, cluster.kernel, pid
        sc = cluster.scenario
        self.shape = cluster.timeline.shape
        self.factory = factory
        n, hidden, tensors = sc.model.local_experts, sc.model.hidden, sc.model.tensors_per_layer
        # Expert weights keep their storage for the worker's whole life (as vLLM's do), so registrations of them
        # stay meaningful across reconfigurations; expert_buffer likewise.
        self.weights = [[torch.full((n, hidden), float("nan")) for _ in range(tensors)] for _ in range(sc.model.layers)]
        self.buffer = [torch.full((n, hidden), float("nan")) for _ in range(tensors)]
        self._tensors = tensors
        self.retired_buffers: list[list[torch.Tensor]] = []
        self.placement = placement
        if placement is not None:
            fill_weights(self.weights, placement, group_rank)
        self.group = group  # the group's rank() is this worker's rank: nothing else keeps it
        self.comm = None
        self.prepared: tuple[Any, Any] | None = None  # (communicator, group)
        self.aborted: Any = None  # vLLM keeps an aborted prepare's communicator until the next prepare
        self.load = LoadWindow(sc.model.layers, sc.model.experts, max(1, sc.eplb.window))
        self._rows = move.RowViews()
        self.stream = cluster.streams[pid] = DeviceStream(cluster.kernel, pid)  # where the row copies run
        # The forward work a serving step leaves queued on a GPU's stream when the host moves on to EPLB (none
        # where the world's memory is host memory: no GPU stream orders anything there).
        from fakes.nixl.profiles import PROFILES

        ahead = sc.serving.host_ahead_steps * sc.serving.step_time_s
        self._ahead_s = ahead if PROFILES[cluster.profile].vram_ok else 0.0
        self.inbox = cluster.kernel.env.event()
        self._queue: list[Command] = []
        self.async_thread = None
        # vLLM's EplbState per model under async EPLB: a rebalance in flight (``rebalanced``), the layer the async
        # thread has staged in expert_buffer and the main thread has not taken yet (``pending``: the layer, and its
        # move_from_buffer to issue), and
        # the event the async thread waits on until it is taken (``consumed``); ``staged`` wakes a drain.
        self.rebalanced = False
        self.pending: tuple[int, Any] | None = None
        self.consumed: Any = None
        self.staged: Any = None
        self._ep_groups: tuple[Any, Any] | None = None  # (EPLB group handle, the EP group over the same members)
        self.cleanup_thread = None  # the retired group's all2all cleanup (elastic-cleanup@pid), while it runs
        self.main_thread = None
        self.alive = True
        # The MoE all2all (all2all.backend != none): the group's manager, the standby one PREPARE builds, the MoE
        # layer's strong reference to its buffer, and the per-process LL class attribute.
        self.a2a: Any = None
        self.prepared_a2a: Any = None
        self.a2a_buffer: Any = None
        self.prepared_a2a_buffer: Any = None
        self.a2a_process: Any = None
        self.a2a_handle: tuple[Any, Any] | None = None  # (weak reference to the buffer, handle) of the last dispatch

    # -- plumbing -----------------------------------------------------------------------------------------------
    def post(self, cmd: Command) -> Any:
        cmd.done = self.kernel.env.event()
        self._queue.append(cmd)
        if not self.inbox.triggered:
            self.inbox.succeed()
        return cmd.done

    def other_thread_name(self) -> str:
        return f"eplb-async@{self.pid}"

    def start(self) -> None:
        self.main_thread = self.kernel.spawn(f"worker@{self.pid}", self.main, pid=self.pid)

    def main(self) -> None:
        while True:
            while not self._queue:
                self.inbox = self.kernel.env.event()
                self.kernel.wait(self.inbox, "waiting for the engine")
            cmd = self._queue.pop(0)
            result = getattr(self, f"do_{cmd.kind}")(**cmd.args)
            cmd.done.succeed(result)
            if cmd.kind == "exit":
                return

    def history(self, kind: str, **fields: Any) -> None:
        self.kernel.history.record(kind, pid=self.pid, **fields)

    def _drop(self, obj: Any, what: str) -> None:
        """``obj`` just lost its owner's reference (the GC controller decides how it goes); the caller's name next."""
        self.cluster.gc.drop(self.pid, obj, what)

    # -- commands -----------------------------------------------------------------------------------------------
    def do_start(self, standby: bool = False) -> Any:
        """Start-up: the first communicator, with no predecessor.  ``standby``: a rank joining a scale-up, whose
        PREPARE builds it on the ElasticEPAsync thread while the old group serves (vLLM 0.33.0's communicator
        gathers every member's agent in its constructor, so it is done only once the old ranks' PREPAREs build
        theirs); the event it returns fires then, as a PREPARE's does."""
        if not standby:
            self._build_first()
            return None
        done = self.kernel.env.event()
        self.kernel.spawn(f"elastic-prepare@{self.pid}", self._build_first, done, pid=self.pid, daemon=True)
        return done

    def _opening_group(self) -> None:
        """A new group's connections (gloo connects a full mesh) before a communicator is built on it: a
        calibrated cost, none otherwise."""
        self.cluster.spend(self.cluster.cost("group_s"), "opening the group")

    def _build_first(self, done: Any = None) -> None:
        self._opening_group()
        self.comm = self.factory(self.group, self.weights, self.buffer, None)
        self.history("comm.create", gen=self.group.group_name, prev=False)
        self.a2a = self._manager(self.group)
        if self.a2a is not None and self._buffers_made_ahead():
            self.a2a_buffer = self.a2a.get_handle()  # the model's load makes its MoE kernels, and with them the buffer
        if done is not None:
            done.succeed()

    def _buffers_made_ahead(self) -> bool:
        """vLLM 0.33.0 makes a group's DeepEP buffer with the MoE kernels that hold it: at model load, and for a new
        group at PREPARE, while the old group's buffer serves (stage_standby_moe_quant_methods: the staged kernels'
        prepare-and-finalize gets the standby manager's handle); pr-53947 (epsim's first model) at the first forward
        step on the group."""
        return self.cluster.scenario.lifecycle == "0.33.0"

    def _manager(self, group):
        """The all2all manager of ``group``'s generation, on its EP group: vLLM builds the DeepEP buffer on the EP
        group's ``cpu_group``, not on the EPLB group the communicator uses, so the buffer's collectives (made at a
        forward step on the main thread) never pair with the async EPLB thread's on the EPLB group."""
        from .all2all import manager_for

        return manager_for(self.cluster.scenario.all2all, _ep_group_of(group), self)

    def do_serve(self, steps: int, loads: np.ndarray) -> None:
        """``steps`` forward steps: they take simulated time and add this rank's share of the expert load; with an
        all2all backend, one MoE forward (dispatch, experts, combine) through the group's buffer stands for them."""
        if self.a2a is not None:  # the chunk's first forward step: the first one on a new group makes its buffer
            from .all2all import forward

            buf = self.a2a_buffer = self.a2a.get_handle()
            seed = derive_seed(self.kernel.seed, f"all2all@{self.pid}@{self.cluster.timeline.step}") % (1 << 63)
            gen = torch.Generator().manual_seed(seed)
            faults = self.cluster.faults
            skew = (
                buf.low_latency_mode
                and faults.take({"all2all.parity_skew": WORKER_SITES["all2all.parity_skew"]}, self.pid, "LL dispatch")
                is not None
            )
            stale = None
            if (
                self.a2a_handle is not None
                and self.a2a_handle[0]() is not buf
                and faults.take({"all2all.stale_handle": WORKER_SITES["all2all.stale_handle"]}, self.pid, "handle")
                is not None
            ):
                stale = self.a2a_handle[1]
            problem, handle = forward(
                buf, self.group.rank(), self.group.size(), gen, extra_dispatch=skew, stale_handle=stale
            )
            self.a2a_handle = (weakref.ref(buf), handle)  # DeepEP's handle is tensors: it keeps no buffer alive
            self.cluster.oracles.all2all_checked(self.pid, problem)
        step = self.cluster.scenario.serving.step_time_s
        if not self.rebalanced:
            self.kernel.sleep(steps * step, "serving")
            self.stream.backlog(self._ahead_s)
        else:
            # While a rebalance is in flight vLLM's EplbState.step runs after every forward step: an all_reduce on
            # the EP group of whether this rank's async thread has staged its layer; when every rank has, each
            # takes it (move_from_buffer), so no rank switches a layer's experts before the others can.
            start, done = self.kernel.now(), 0
            while done < steps and self.rebalanced:
                done += 1
                self.kernel.sleep(start + done * step - self.kernel.now(), "serving")
                self.stream.backlog(self._ahead_s)
                self._eplb_step()
            if done < steps:
                self.kernel.sleep(start + steps * step - self.kernel.now(), "serving")
                self.stream.backlog(self._ahead_s)
        self.load.record(loads, steps)

    def _ep_group(self):
        """The EP group of this worker's generation (its EPLB group, ``self.group``, is the communicator's)."""
        if self._ep_groups is None or self._ep_groups[0] is not self.group:
            self._ep_groups = (self.group, _ep_group_of(self.group))
        return self._ep_groups[1]

    def _eplb_step(self) -> bool:
        """vLLM's ``_all_ranks_result_ready``, then ``_move_to_workspace`` when every rank has its layer staged;
        whether it took one."""
        ep = self._ep_group()
        ready = torch.tensor([int(self.pending is not None)], dtype=torch.int32)
        dist.all_reduce(ready, group=ep)
        if int(ready.item()) != ep.size():
            return False
        self._take_layer()
        return True

    def _take_layer(self) -> None:
        """The main thread takes the staged layer: ``move_from_buffer`` on the compute stream, then the consumed
        event lets the async thread start the next layer's transfers; the last layer ends the rebalance."""
        assert self.pending is not None  # every rank has its layer staged (_eplb_step)
        layer, move_from_buffer = self.pending
        self.pending = None
        move_from_buffer()
        if layer == len(self.weights) - 1:
            self.rebalanced = False
        consumed, self.consumed = self.consumed, None
        consumed.succeed()

    def do_rearrange(
        self, old: Placement, new: Placement, mapping: dict[int, int] | None, use_async: bool, skip: bool = False
    ) -> None:
        """EPLB rearrange: all-reduce the load, then move every layer through the communicator (``use_async``: on
        the async EPLB thread, at most one layer per forward step, while the main thread keeps serving; ``skip``:
        the policy's placement gains too little, nothing moves)."""
        if self.cluster.scenario.lifecycle == "0.33.0":
            self._postpone_while_in_flight()
        self.join_async()
        total = torch.from_numpy(self.load.total().astype(np.float64))
        dist.all_reduce(total, group=self.group)
        if skip:
            self.history("eplb.skipped")
            return
        if use_async:
            self.rebalanced = True
            self.async_thread = self.kernel.spawn(
                self.other_thread_name(), self._move, old, new, mapping, True, pid=self.pid, daemon=True
            )
        else:
            self._move(old, new, mapping, False)

    def _postpone_while_in_flight(self) -> None:
        """vLLM 0.33.0's ``EplbState.step``: a rebalance that comes due while one is in flight waits (the step
        counter is not reset); the forward steps go on, each with its readiness all_reduce and take, and the
        rebalance runs at the first step after the last layer is in.  Every rank is at the same layer (the takes
        are in lockstep), so they all postpone for the same steps."""
        if not self.rebalanced:
            return
        step, steps = self.cluster.scenario.serving.step_time_s, 0
        while self.rebalanced:
            steps += 1
            self.kernel.sleep(step, "serving (rebalance postponed)")
            self.stream.backlog(self._ahead_s)
            self._eplb_step()
        self.history("eplb.postponed", steps=steps)

    def do_drain(self) -> None:
        if self.cluster.scenario.lifecycle == "0.33.0":
            self.drain_async()
        self.join_async()

    def drain_async(self) -> None:
        """vLLM 0.33.0's ``EplbState.drain_async`` (the scale-up commit, the scale-down reshuffle): until the last
        layer is in, an all_reduce over the EP group of whether each rank has its layer staged; when every rank has,
        each takes it, else all poll again 1 ms later.  vLLM acknowledges the layer without applying it (a full
        rearrange follows); epsim applies it, so that the placement stays one map per EP size
        (docs/simulation.md says why the verdicts are the same)."""
        th = self.async_thread
        if th is None:
            return
        while self.rebalanced and th.alive:
            if not self._eplb_step():
                self.kernel.sleep(0.001, "draining async EPLB")

    def join_async(self) -> None:
        """Take every layer still to come as the async thread stages it (this rank alone, no collective), then wait
        for the thread to finish its checks: what is left after 0.33.0's drain (nothing), and the whole drain under
        the later revision, which drains at abort, exit and rebalance too."""
        th, self.async_thread = self.async_thread, None
        if th is None:
            return
        while self.rebalanced and th.alive:
            if self.pending is not None:
                self._take_layer()
                continue
            self.staged = self.kernel.env.event()
            self.kernel.wait(self.kernel.env.any_of([self.staged, th.done]), "draining async EPLB")
            self.staged = None
        if th.alive:
            self.kernel.wait(th.done, "draining async EPLB")
        # Over either way; a thread that crashed (a crash verdict already) leaves nothing for the steps to wait on.
        self.rebalanced, self.pending = False, None

    @staticmethod
    def _row_copies(plan) -> int:
        """Expert rows one layer's move copies per weight tensor: each local copy in and out of expert_buffer,
        each received row out of it, each extra copy of a received row."""
        return 2 * len(plan.local_copies) + len(plan.recvs) + len(plan.recv_copies)

    def _copying(self, rows: int, why: str) -> None:
        self.cluster.spend(self.cluster.host_copy_s(rows, self.cluster.nominal_row_bytes), why)

    def _move(self, old: Placement, new: Placement, mapping, paced: bool) -> None:
        # The move runs on the group this worker's communicator belongs to: the old group for a scale-down
        # (before commit), the new one for a scale-up (after commit), so the group rank is the move's rank.
        comm, rank = self.comm, self.group.rank()
        lag = self.cluster.faults.take(
            {"device.stream_lag": WORKER_SITES["device.stream_lag"]}, self.pid, "expert copies"
        )
        self.stream.lag_s = float(lag.params.get("delay_s", 0.01)) if lag is not None else 0.0
        loop = vllm_move_loop.of(self.factory)  # vLLM's own rebalance_execute, for vLLM's communicator
        self.cluster.vllm_moved |= loop is not None
        at_once = loop is not None and not paced  # vLLM's rearrange_expert_weights_inplace moves every layer itself
        if loop is not None and at_once:
            for layer in range(old.num_layers):
                self.cluster.recvs_planned += len(self.cluster.plan(old, new, layer, mapping)[rank].recvs)
            loop.rearrange(
                old.physical_to_logical,
                new.physical_to_logical,
                self.weights,
                self.buffer,
                self.group,
                comm,
                mapping,
                self.stream,
            )
            # Its row copies' host time (host memory, calibrated), after the layers: the loop is vLLM's, unmodified.
            self._copying(
                sum(
                    self._row_copies(self.cluster.plan(old, new, layer, mapping)[rank])
                    for layer in range(old.num_layers)
                )
                * self._tensors,
                "vLLM's row copies",
            )
        for layer in range(0 if at_once else old.num_layers):
            old_idx, _ = self.cluster.indices(old, new, layer, mapping)
            plan = self.cluster.plan(old, new, layer, mapping)[rank]
            self.cluster.recvs_planned += len(plan.recvs)
            if not paced:
                # move_layer, with the host time of its row copies where they are memcpy (host memory, calibrated):
                # the local copies staged before the READs, the rest out of expert_buffer after the barrier.
                self._copying(len(plan.local_copies) * self._tensors, "staging local copies")
                move.transfer_layer(
                    comm, layer, old_idx, self.weights[layer], self.buffer, plan, self._rows, self.stream
                )
                move.issue_move_from_buffer(self.weights[layer], self.buffer, plan, self._rows, self.stream, layer)
                self._copying((self._row_copies(plan) - len(plan.local_copies)) * self._tensors, "move_from_buffer")
                continue
            # vLLM's async EPLB worker: a coordinated stop first (every rank still rebalancing, or all stop: an
            # all_reduce on the EPLB group), then the layer's local copies on a stream of its own that waits for
            # the consumed event of the layer before (so they run after its move_from_buffer: one in-order stream
            # here), the READs, execute, a synchronize of that stream; then the layer is published and this
            # thread waits until the main thread has taken it (``_eplb_step``, at a step boundary once every rank
            # has it) and issued move_from_buffer on the compute stream; the next layer's READs then run in no
            # order with that stream.
            # Nothing in the simulation clears one rank's ``rebalanced`` while others rebalance, so the stop never
            # fires here; the collective is kept as vLLM makes it (where a rank dies, everyone's async thread waits
            # in it). If it fired, the main threads would read the cleared flag at different steps, as in vLLM.
            going = torch.tensor([int(self.rebalanced)], dtype=torch.int32)
            dist.all_reduce(going, group=self.group)
            if int(going.item()) != self.group.size():
                self.rebalanced = False
                self.history("eplb.stopped", layer=layer)
                break
            if loop is None:
                move.transfer_layer(
                    comm, layer, old_idx, self.weights[layer], self.buffer, plan, self._rows, self.stream
                )
                take = functools.partial(
                    move.issue_move_from_buffer, self.weights[layer], self.buffer, plan, self._rows, self.stream, layer
                )
            else:
                meta = loop.transfer_layer(
                    layer,
                    old.physical_to_logical,
                    new.physical_to_logical,
                    self.weights[layer],
                    self.buffer,
                    self.group,
                    comm,
                    mapping,
                    self.stream,
                )
                take = functools.partial(
                    loop.move_from_buffer,
                    layer,
                    new.physical_to_logical,
                    meta,
                    self.weights[layer],
                    self.buffer,
                    rank,
                    self.stream,
                )
            self.stream.synchronize("async EPLB: the experts stream after a layer's transfers")
            self.consumed = self.kernel.env.event()
            self.pending = (layer, take)
            if self.staged is not None and not self.staged.triggered:
                self.staged.succeed()
            self.kernel.wait(self.consumed, "async EPLB: waiting for the main thread to take the layer")
        space = move.rank_space(old, new, mapping)
        new_rank = space.to_new[rank]
        self.placement = new if new_rank >= 0 else None
        # The next forward step reads the weights in stream order: it sees every copy issued before it.
        self.stream.flush("the next forward step reads the weights")
        if new_rank >= 0:
            problems = check_weights(self.weights, new, new_rank, self._rows.arrays)
            self.cluster.oracles.weights_checked(self.pid, problems)
        self.history("eplb.rearranged", moved_layers=old.num_layers)

    def do_prepare(self, group, prepare_s: float, build_step: int | None = None) -> Any:
        """PREPARE on the ElasticEPAsync thread: a new communicator for the new group, built from the old one,
        ``prepare_s`` later; ``build_step`` is the forward step the engine's serving reaches then."""
        if self.aborted is not None:
            aborted, self.aborted = self.aborted, None
            self.cluster.gc.drop(self.pid, aborted, "aborted communicator")
            del aborted
        # Its worker faults are decided now, for the step it builds at, as the real parent decides them when it
        # posts (its ranks build at once).  Deciding them at the build read the engine's count at an instant it
        # could still be one serving chunk behind (whichever the tie-break woke first): a fault due in the window's
        # last chunk fired on some ranks and not others, by seed; and in a run that ended inside the window they
        # counted as fired on real ranks only.
        fired = self.cluster.faults.take_prepare(self.pid, build_step)
        done = self.kernel.env.event()
        self.kernel.spawn(
            f"elastic-prepare@{self.pid}",
            self._prepare,
            group,
            prepare_s,
            done,
            fired["storage.move"],
            fired["peer.restart"],
            pid=self.pid,
            daemon=True,
        )
        return done

    def _prepare(self, group, prepare_s: float, done, storage_move: bool, peer_restart: bool) -> None:
        # vLLM's prepare begins by waiting for the previous reconfiguration's group cleanup (_wait_for_group_cleanup):
        # a retired group's buffers are gone before standby groups are built.
        self._wait_for_group_cleanup()
        self.kernel.sleep(prepare_s, "building standby groups")
        self._opening_group()
        if storage_move:
            # New storage; the old tensors stay referenced (by the old communicator's registrations in reality,
            # here by the worker) so nothing reads freed memory.
            self.retired_buffers.append(self.buffer)
            self.buffer = [torch.full_like(b, float("nan")) for b in self.buffer]
            self.history("storage.move", what="expert_buffer")
        if peer_restart:
            self.history("peer.restart", agents=self.cluster.restart_agents(self.pid))
        comm = self.factory(group, self.weights, self.buffer, self.comm)
        self.prepared = (comm, group)
        del comm
        self.history("comm.create", gen=group.group_name, prev=True)
        self.prepared_a2a = self._manager(group)  # the standby all2all manager
        if self.prepared_a2a is not None and self._buffers_made_ahead():
            self.prepared_a2a_buffer = self.prepared_a2a.get_handle()  # held by the staged kernels until COMMIT
        done.succeed()

    def do_commit(self) -> None:
        """COMMIT: drain, collect (switch_and_prepare's _release_cuda_graphs calls gc.collect()), swap; the old
        communicator is dropped here and lives on only as long as something else holds it.  vLLM 0.33.0 then
        collects again (warm_and_capture releases the graphs once more), before the retired groups' cleanup
        starts: an old communicator that only a reference cycle kept is finalized inside the reconfiguration."""
        self.join_async()
        self.cluster.gc.collect(f"commit@{self.pid}", self.pid)
        assert self.prepared is not None, "COMMIT without PREPARE"
        comm, group = self.prepared
        self.prepared = None
        old, self.comm = self.comm, comm
        self.group = group
        del comm
        self.history("comm.swap", gen=group.group_name)
        self.cluster.gc.drop(self.pid, old, "old communicator")
        del old
        retired = self._switch_all2all() if self.a2a is not None else None
        if self.cluster.scenario.lifecycle == "0.33.0":
            self.cluster.gc.collect(f"warm_and_capture@{self.pid}", self.pid)
        if retired is not None:
            self._start_group_cleanup(retired)

    def _switch_all2all(self) -> Any:
        """The new group's manager serves from now on and the MoE layer drops its old buffer; the retired manager."""
        from .all2all import switch

        return switch(self, self._drop)

    def _start_group_cleanup(self, retired) -> None:
        """The retired group's manager is destroyed on a background thread (vLLM's ``_start_group_cleanup``) while
        the new group serves."""
        late = self.cluster.faults.take(
            {"all2all.cleanup_late": WORKER_SITES["all2all.cleanup_late"]}, self.pid, "all2all cleanup"
        )
        delay = float(late.params.get("delay_s", 1.0)) if late is not None else 0.0
        self.cleanup_thread = self.kernel.spawn(
            f"elastic-cleanup@{self.pid}", self._cleanup_all2all, retired, delay, pid=self.pid, daemon=True
        )

    def _wait_for_group_cleanup(self) -> None:
        """vLLM's ``_wait_for_group_cleanup``: the retired group's cleanup, if one runs, is done when this returns."""
        th, self.cleanup_thread = self.cleanup_thread, None
        if th is not None and th.alive:
            self.kernel.wait(th.done, "waiting for the group cleanup")

    def _cleanup_all2all(self, manager, delay: float) -> None:
        if delay > 0:
            self.kernel.sleep(delay, "all2all.cleanup_late")
        destroyed = manager.destroy()
        self.history("all2all.cleanup", destroyed=destroyed)

    def do_abort(self) -> None:
        self.join_async()
        if self.prepared is not None:
            self.aborted = self.prepared[0]
            self.prepared = None
        self.history("comm.abort")

    def do_remove(self) -> None:
        """A leaving rank's COMMIT under vLLM 0.33.0 (``commit_scale_down(removing=True)``, right after the reshuffle
        and alongside the survivors' COMMIT): ``switch_and_remove`` waits for an earlier cleanup, releases the graphs
        (a collection) and destroys every retired group, its all2all manager (and so its buffers) among them, on the
        cleanup thread, waiting for it.  The communicator and the MoE layer's buffer go at exit."""
        from .all2all import retire_managers

        self.join_async()
        self._wait_for_group_cleanup()
        self.cluster.gc.collect(f"remove@{self.pid}", self.pid)
        for manager in retire_managers(self):
            self._start_group_cleanup(manager)
            self._wait_for_group_cleanup()  # a cleanup that raises is a crash

    def do_exit(self) -> None:
        """Leave: the process ends.  Nothing in vLLM releases EPLB explicitly; references just go away."""
        self.join_async()
        for name in ("prepared", "aborted"):
            value = getattr(self, name)
            setattr(self, name, None)
            if value is not None:
                obj = value[0] if isinstance(value, tuple) else value
                del value
                self.cluster.gc.drop(self.pid, obj, name)
                del obj
        comm, self.comm = self.comm, None
        if comm is not None:
            self.cluster.gc.drop(self.pid, comm, "communicator at exit")
        del comm
        if self.a2a is not None:
            from .all2all import shut_down

            shut_down(self, self._drop)
        # The interpreter's last collections at exit, as a real process's (and the real backend's rank) run them:
        # a communicator a gc.cycle fault put in a cycle is finalized here, not lost with the process.
        self.cluster.gc.collect(f"exit@{self.pid}", self.pid)
        # Then the process ends: the interpreter's teardown with torch and NIXL loaded (calibrated; none otherwise).
        self.cluster.spend(self.cluster.cost("teardown_s"), "the process's teardown at exit")
        self.alive = False
        self.history("worker.exit")
