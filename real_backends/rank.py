"""One real rank: an OS process running a vLLM-style worker with real NIXL agents and gloo groups.

The parent (:mod:`real_backends.cluster`) starts it with a pipe and posts it the same commands the simulated
workers take (start, serve, rearrange, drain, prepare, commit, abort, exit).  Commands run on the main thread;
PREPARE and the async EPLB move run on threads of their own, as in vLLM.  Everything the oracles judge is streamed
to the parent as it happens: the NIXL ledger (:mod:`real_backends.ledger`), the worker's own events, and a crash as
soon as an exception escapes the code under test.

Faults that exist in reality are done for real here: a dropped communicator held for ``delay_s`` and released on a
thread of its own (``gc.late``), put in a reference cycle for the next ``gc.collect()`` (``gc.cycle``), released on
another thread (``gc.thread``) or kept until interpreter exit (``gc.never``); ``expert_buffer`` reallocated before
PREPARE (``storage.move``); every agent restarted under its name (``peer.restart``).

With an ``all2all`` DeepEP backend (a GPU and a DeepEP build) the rank runs vLLM's managers as the simulation's
worker does (``sim/all2all.py``): a real ``deep_ep.Buffer`` per EP group, made at model load and at PREPARE under
vLLM 0.33.0 (on the first forward step under pr-53947), one MoE forward through it per serving command, the old
buffer dropped at COMMIT and the retired group's manager destroyed on ``elastic-cleanup@pid``.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

_IMMORTAL: list[Any] = []  # gc.never: lives until interpreter shutdown, like an object no collection ever reaches


@dataclass
class RankConfig:
    pid: int
    parent: int | None  # the parent's OS pid: this process dies with it (None: a torchrun slot, torchrun's job)
    scenario: dict[str, Any]
    strategy: str
    device: str
    store: tuple[str, int]
    group: Any  # GroupSpec of the group this rank starts in
    placement: Any  # Placement for a rank of the first group; None for a rank added by scale-up
    timeout_s: float


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (also by SIGKILL).  Also a ``preexec_fn``: the catalogue's
    children die with a killed ``epsim validate`` or ``epsim conform`` (no real NIXL agent left behind)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's timeout or its own stop still ends the child
        pass


def _die_with_parent(parent: int) -> None:
    """No rank outlives its run: :func:`die_with_parent`, and an exit if the parent died before that took effect."""
    die_with_parent()
    if os.getppid() != parent:
        os._exit(1)


class Link:
    """The pipe to the parent; any thread may send (one lock), only the main thread receives."""

    def __init__(self, conn, pid: int) -> None:
        self.conn, self.pid = conn, pid
        self._lock = threading.Lock()
        self._seq = 0

    def send(self, *msg: Any) -> None:
        try:
            with self._lock:
                self.conn.send(msg)
        except (OSError, ValueError, EOFError):
            pass  # the parent is gone, or interpreter shutdown closed the pipe: nothing left to tell

    def emit(self, kind: str, **fields: Any) -> None:
        with self._lock:
            self._seq += 1
            seq = self._seq
        self.send("event", time.monotonic(), self.pid, seq, kind, fields)


class _LaggingStream:
    """Fault ``device.stream_lag`` on a GPU: a sleep kernel of ``lag_s`` on the current stream in front of each row
    copy, so the stream is that far behind when the copy is issued (the simulation's ``sim.device.DeviceStream``
    under the same fault).  The copies are non_blocking tensor ops: they queue behind the sleep."""

    def __init__(self, lag_s: float, device: Any) -> None:
        import torch

        self._torch, self._device = torch, device
        self._cycles = max(1, int(lag_s * _cycles_per_second(device)))

    def submit(self, op, what: str) -> None:
        with self._torch.cuda.device(self._device):
            self._torch.cuda._sleep(self._cycles)
        op()

    def synchronize(self, reason: str = "synchronize") -> None:
        self._torch.cuda.current_stream(self._device).synchronize()


class _ForwardWork:
    """The forward work a serving step leaves queued on a GPU's current stream (``serving.host_ahead_steps``): a
    sleep kernel of ``ahead_s``, launched only when the stream has run everything before it (the simulation's
    ``DeviceStream.backlog``: busy until at least ``ahead_s`` from now)."""

    def __init__(self, ahead_s: float, device: Any) -> None:
        import torch

        self._torch, self._device = torch, device
        self._cycles = max(1, int(ahead_s * _cycles_per_second(device)))

    def launch(self) -> None:
        stream = self._torch.cuda.current_stream(self._device)
        if stream.query():
            with self._torch.cuda.device(self._device):
                self._torch.cuda._sleep(self._cycles)


@functools.lru_cache(maxsize=None)
def _cycles_per_second(device: Any) -> float:
    """How many ``torch.cuda._sleep`` cycles make a second on ``device`` (measured once per process)."""
    import torch

    cycles = 20_000_000
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) / 1e3)


class RealWorker:
    def __init__(self, cfg: RankConfig, link: Link) -> None:
        import torch

        from sim import scenario as scenario_mod
        from sim.eplb import move
        from sim.eplb.communicators import plugins
        from sim.eplb.state import LoadWindow, fill_weights

        from .groups import connect_store

        self.cfg, self.link, self.pid = cfg, link, cfg.pid
        self.sc = scenario_mod.from_dict(cfg.scenario)
        m = self.sc.model
        self.factory = plugins.load(cfg.strategy, fresh=False)
        device = torch.device(cfg.device)
        self.weights = [
            [torch.full((m.local_experts, m.hidden), float("nan"), device=device) for _ in range(m.tensors_per_layer)]
            for _ in range(m.layers)
        ]
        self.buffer = [
            torch.full((m.local_experts, m.hidden), float("nan"), device=device) for _ in range(m.tensors_per_layer)
        ]
        self.retired_buffers: list[Any] = []
        if cfg.placement is not None:
            fill_weights(self.weights, cfg.placement, cfg.group.rank)
        self.store = connect_store(*cfg.store, cfg.timeout_s)
        self.group_spec = cfg.group
        self.group: Any = None  # the EPLB group's torch ProcessGroup, made at load and at every COMMIT
        self.comm: Any = None
        self.prepared: tuple[Any, Any, Any, Any] | None = None  # (communicator, group, its spec, EP group)
        self.aborted: Any = None
        self.load = LoadWindow(m.layers, m.experts, max(1, self.sc.eplb.window))
        self.async_thread: threading.Thread | None = None
        # As the simulation's worker: vLLM's EplbState under async EPLB (a rebalance in flight, the layer the async
        # thread staged and the main thread has not taken, the event it waits on), guarded by one condition; and
        # the EP group that vLLM's readiness all_reduce runs on, beside the communicator's EPLB group.
        self.rebalanced = False
        self.pending: tuple[int, Any] | None = None  # (layer, its move_from_buffer to issue)
        self.consumed: threading.Event | None = None
        self.eplb_state = threading.Condition()
        self.ep_group: Any = None
        self.step = 0
        self.gc_faults: dict[str, dict[str, Any]] = {}  # what -> the GC fault the parent chose for that drop
        # The lists through which gc.late, gc.thread and gc.never hold a dropped communicator (the exit's leak check
        # leaves what only they hold alone); a gc.cycle holder is referenced by itself alone.
        self.fault_holders: list[list] = []
        # A GC fault's release finalizes on a thread of its own while the main thread goes on; exit's leak check
        # must not look at one half done (the holder emptied, the finalizer still deregistering: a leak that is
        # not one, seen under load). gc.thread's releases are joined before it looks (in the simulation they run at
        # the instant of the drop, long before exit); a gc.late release takes this lock, as the check does, so it
        # is either over before the check or never starts (its object then counts as held, a gc.late still waiting).
        self.gc_threads: list[threading.Thread] = []
        self.release_lock = threading.Lock()
        self.exiting = False
        self._rows = move.RowViews()
        self._rearrange_started = 0.0
        # The forward work a serving step leaves queued on the GPU when the host goes on to EPLB (the simulation's
        # serving.host_ahead_steps, in the scenario's own seconds): a sleep kernel, launched only when the stream
        # has caught up, so that it is at most that far behind however fast the scaled steps below run.
        ahead = (self.sc.serving.host_ahead_steps or 0.0) * self.sc.serving.step_time_s  # (filled in by validation)
        self._forward_work = _ForwardWork(ahead, device) if ahead > 0 and device.type == "cuda" else None
        # The MoE all2all (all2all.backend != none), as the simulation's worker: the group's manager, the standby one
        # PREPARE builds, the buffers the MoE layer and the staged kernels hold, and the retired group's cleanup.
        self.a2a: Any = None
        self.prepared_a2a: Any = None
        self.a2a_buffer: Any = None
        self.prepared_a2a_buffer: Any = None
        self.a2a_process: Any = None
        self.cleanup_thread: threading.Thread | None = None

    def history(self, kind: str, **fields: Any) -> None:
        self.link.emit(kind, pid=self.pid, **fields)

    def run_thread(self, name: str, fn, *args: Any) -> threading.Thread:
        """A thread whose escaping exception is a crash, reported at once (as the simulation's kernel does)."""

        def body() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - reported to the parent, which judges it
                report_crash(self.link, self.pid, name, exc)

        th = threading.Thread(target=body, name=name, daemon=True)
        th.start()
        return th

    # -- commands -----------------------------------------------------------------------------------------------
    def do_start(self, standby: bool = False) -> str | None:
        from .groups import open_group

        # The groups first, on this thread (the old ranks' PREPAREs open theirs at once): the parent serves no step
        # until every process is up and connected, so the steps served while the communicators build are as many
        # as the simulation's (a new rank's start-up is not part of the scenario's prepare_s).
        self.group = open_group(self.store, self.group_spec, self.cfg.timeout_s)
        self.ep_group = self._open_ep_group(self.group_spec)
        # standby: a rank joining a scale-up builds in the background while the old group serves (sim/worker.py)
        if not standby:
            self._build_first()
            return None
        self.run_thread(f"elastic-prepare@{self.pid}", self._build_first, True)
        return "started"

    def _build_first(self, standby: bool = False) -> None:
        self.comm = self.factory(self.group, self.weights, self.buffer, None)
        self.history("comm.create", gen=self.group_spec.name, prev=False)
        self.a2a = self._manager(self.ep_group)
        if self.a2a is not None and self._buffers_made_ahead():
            self.a2a_buffer = self.a2a.get_handle()  # the model's load makes its MoE kernels, and with them the buffer
        if standby:
            self.link.send("prepared", self.pid)

    def _open_ep_group(self, spec):
        """The generation's EP group (async EPLB's readiness collectives; the all2all buffer is built on it),
        opened right after its EPLB group by every member, so the two meshes pair up in the same order everywhere."""
        from .groups import GroupSpec, open_group

        if not self.sc.eplb.use_async and self.sc.all2all.backend == "none":
            return None
        return open_group(self.store, GroupSpec(f"{spec.name}/ep", spec.rank, spec.size), self.cfg.timeout_s)

    # -- the MoE all2all (sim/worker.py's, over a real DeepEP) ---------------------------------------------------
    def _buffers_made_ahead(self) -> bool:
        """vLLM 0.33.0 makes a group's buffer with the MoE kernels (model load, PREPARE); pr-53947 on the group's
        first forward step."""
        return self.sc.lifecycle == "0.33.0"

    def _manager(self, ep_group):
        from sim.all2all import manager_for

        return manager_for(self.sc.all2all, ep_group, self)

    def _forward(self) -> None:
        """One MoE forward (dispatch, experts, combine) through the group's buffer, checked against the reference;
        the first on a new group makes its buffer."""
        import torch

        from sim.all2all import forward
        from sim.rng import derive_seed

        buf = self.a2a_buffer = self.a2a.get_handle()
        gen = torch.Generator().manual_seed(derive_seed(self.sc.seed, f"all2all@{self.pid}@{self.step}") % (1 << 63))
        problem, _ = forward(buf, self.group.rank(), self.group.size(), gen, device=self.cfg.device)
        self.history("all2all.checked", problem=problem)

    def _switch_all2all(self) -> Any:
        """COMMIT: the new group's manager serves and the MoE layer drops its old buffer; the retired manager."""
        from sim.all2all import switch

        return switch(self, self.drop)

    def _start_group_cleanup(self, retired) -> None:
        """The retired group's manager is destroyed on a background thread (vLLM's ``_start_group_cleanup``) while
        the new group serves.  Started last in COMMIT, as vLLM starts it: its destroy() keeps the GIL while it waits
        for the old group's other ranks, so a thread started earlier would stop COMMIT itself until they come."""
        self.cleanup_thread = self.run_thread(f"elastic-cleanup@{self.pid}", self._cleanup_all2all, retired)

    def _wait_for_group_cleanup(self) -> None:
        """vLLM's ``_wait_for_group_cleanup``: the retired group's cleanup, if one runs, is done when this returns."""
        th, self.cleanup_thread = self.cleanup_thread, None
        if th is not None:
            th.join()

    def _cleanup_all2all(self, manager) -> None:
        self.history("all2all.cleanup", destroyed=manager.destroy())

    def do_serve(self, steps: int, loads) -> None:
        # Serving takes no time here, except while a rebalance is in flight: then each forward step (a hundredth of
        # the scenario's, as the real backend scales them, so that a test run stays short) ends with vLLM's
        # readiness all_reduce on the EP group, and every rank takes the staged layer once all have it.
        if self.a2a is not None:
            self._forward()
        step = self.sc.serving.step_time_s * 0.01
        done = 0
        while done < steps and self.rebalanced:
            done += 1
            time.sleep(step)
            self._queue_forward_work()
            self._eplb_step()
        self._queue_forward_work()
        self.load.record(loads, steps)

    def _queue_forward_work(self) -> None:
        if self._forward_work is not None:
            self._forward_work.launch()

    def _eplb_step(self) -> bool:
        """As the simulation's worker: whether every rank had its layer staged, and so took it."""
        import torch
        import torch.distributed as dist

        with self.eplb_state:
            ready = torch.tensor([int(self.pending is not None)], dtype=torch.int32)
        dist.all_reduce(ready, group=self.ep_group)
        if int(ready.item()) != self.ep_group.size():
            return False
        self._take_layer()
        return True

    def _take_layer(self) -> None:
        with self.eplb_state:
            assert self.pending is not None and self.consumed is not None  # staged together (_eplb_step)
            layer, move_from_buffer = self.pending
            self.pending = None
            consumed, self.consumed = self.consumed, None
            try:
                move_from_buffer()
                if layer == len(self.weights) - 1:
                    self.rebalanced = False
                    self.eplb_state.notify_all()  # a PREPARE waiting for the rebalance to land (_prepare)
            finally:  # a copy that raised is a crash, reported; the async thread must not wait for ever behind it
                consumed.set()

    def do_rearrange(self, old, new, mapping, use_async: bool, stream_lag_s: float = 0.0, skip: bool = False) -> None:
        import numpy as np
        import torch
        import torch.distributed as dist

        if self.sc.lifecycle == "0.33.0":
            self._postpone_while_in_flight()
        self.join_async()
        self._rearrange_started = time.perf_counter()
        total = torch.from_numpy(self.load.total().astype(np.float64))
        dist.all_reduce(total, group=self.group)
        if skip:  # as the simulation's worker
            self.history("eplb.skipped")
            return
        stream = _LaggingStream(stream_lag_s, self.weights[0][0].device) if stream_lag_s > 0 else None
        if use_async:
            self.rebalanced = True
            self.async_thread = self.run_thread(f"eplb-async@{self.pid}", self._move, old, new, mapping, True, stream)
        else:
            self._move(old, new, mapping, False, stream)

    def _postpone_while_in_flight(self) -> None:
        """vLLM 0.33.0: a rebalance due while one is in flight waits for it, the steps going on (as the
        simulation's worker, with its scaled steps)."""
        step, steps = self.sc.serving.step_time_s * 0.01, 0
        while self.rebalanced:
            steps += 1
            time.sleep(step)
            self._queue_forward_work()
            self._eplb_step()
        if steps:
            self.history("eplb.postponed", steps=steps)

    def do_drain(self) -> None:
        if self.sc.lifecycle == "0.33.0":
            self.drain_async()
        self.join_async()

    def drain_async(self) -> None:
        """vLLM 0.33.0's ``drain_async`` (as the simulation's worker): the readiness all_reduce over the EP group
        until the last layer is in, each rank taking the layer when every rank has it, else polling again in 1 ms."""
        th = self.async_thread
        if th is None:
            return
        while self.rebalanced and th.is_alive():
            if not self._eplb_step():
                time.sleep(0.001)

    def join_async(self) -> None:
        """Take each layer still to come as the async thread stages it, then join it (after 0.33.0's drain, nothing is
        left; the later revision drains this way alone, at abort, exit and rebalance too)."""
        th, self.async_thread = self.async_thread, None
        if th is None:
            return
        while True:
            with self.eplb_state:
                self.eplb_state.wait_for(
                    lambda: self.pending is not None or not self.rebalanced or not th.is_alive(), timeout=0.1
                )  # a thread that crashed publishes nothing more
                if not self.rebalanced or not th.is_alive():
                    break
                staged = self.pending is not None
            if staged:
                self._take_layer()
        th.join()
        with self.eplb_state:  # over either way (a crashed thread was reported to the parent already)
            self.rebalanced, self.pending = False, None
            self.eplb_state.notify_all()

    def _move(self, old, new, mapping, paced: bool, stream=None) -> None:
        import torch
        import torch.distributed as dist

        from sim.eplb import move
        from sim.eplb.state import check_weights

        from sim.vllm import move_loop as vllm_move_loop

        comm, rank = self.comm, self.group.rank()
        loop = vllm_move_loop.of(self.factory)  # vLLM's own rebalance_execute, for vLLM's communicator
        if loop is not None:
            self.history("eplb.move_loop", loop="vllm")  # a metric (real_backends/judge.py), as in the simulation
        at_once = loop is not None and not paced  # vLLM's rearrange_expert_weights_inplace moves every layer itself
        if loop is not None and at_once:
            loop.rearrange(
                old.physical_to_logical,
                new.physical_to_logical,
                self.weights,
                self.buffer,
                self.group,
                comm,
                mapping,
                stream,
            )
        for layer in range(0 if at_once else old.num_layers):
            old_idx, _ = move.layer_indices(old, new, layer, mapping)
            plan = move.plan_all(old, new, layer, mapping)[rank]
            if not paced:
                move.move_layer(comm, layer, old_idx, self.weights[layer], self.buffer, plan, self._rows, stream)
                continue
            # As the simulation's worker: the coordinated stop (an all_reduce on the EPLB group), the transfer
            # (local copies on the stream, after the layer before's move_from_buffer; then a synchronize), then
            # the layer is published and this thread waits until the main thread has taken it (copied out of
            # expert_buffer on the (lagging) stream at a step boundary once every rank has it).
            going = torch.tensor([int(self.rebalanced)], dtype=torch.int32)  # never stops here: see sim/worker.py
            dist.all_reduce(going, group=self.group)
            if int(going.item()) != self.group.size():
                with self.eplb_state:
                    self.rebalanced = False
                    self.eplb_state.notify_all()
                self.history("eplb.stopped", layer=layer)
                break
            if loop is None:
                move.transfer_layer(comm, layer, old_idx, self.weights[layer], self.buffer, plan, self._rows, stream)
                take = functools.partial(
                    move.issue_move_from_buffer, self.weights[layer], self.buffer, plan, self._rows, stream, layer
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
                    stream,
                )
                take = functools.partial(
                    loop.move_from_buffer,
                    layer,
                    new.physical_to_logical,
                    meta,
                    self.weights[layer],
                    self.buffer,
                    rank,
                    stream,
                )
            if stream is not None:
                stream.synchronize("async EPLB: the experts stream after a layer's transfers")
            consumed = threading.Event()
            with self.eplb_state:
                self.consumed, self.pending = consumed, (layer, take)
                self.eplb_state.notify_all()
            consumed.wait()
        # What the simulation's time model predicts: the load all-reduce and the layers' moves, not the checks below.
        self.history("eplb.moved", seconds=time.perf_counter() - self._rearrange_started)
        new_rank = move.rank_space(old, new, mapping).to_new[rank]
        if new_rank >= 0:
            problems = check_weights(self.weights, new, new_rank)
            self.history("eplb.checked", problems=problems[:1], count=len(problems))
        self.history("eplb.rearranged", moved_layers=old.num_layers)

    def do_prepare(
        self,
        group,
        prepare_s: float,
        build_step: int | None = None,
        storage_move: bool = False,
        peer_restart: bool = False,
    ) -> str:
        # (prepare_s and build_step: the parent serves the window and decided the faults for its end)
        if self.aborted is not None:
            aborted, self.aborted = self.aborted, None
            self.drop(aborted, "aborted communicator")
            del aborted
        self.run_thread(f"elastic-prepare@{self.pid}", self._prepare, group, storage_move, peer_restart)
        return "started"

    def _prepare(self, spec, storage_move: bool, peer_restart: bool) -> None:
        import torch

        from . import ledger
        from .groups import open_group

        group = open_group(self.store, spec, self.cfg.timeout_s)
        ep_group = self._open_ep_group(spec)
        # The simulated PREPARE takes the scenario's prepare_s while the group serves, so an async rebalance in
        # flight when it starts has landed before its faults and its new communicator (every built-in scenario's
        # prepare_s outlasts one).  A real PREPARE takes no time of its own (and new ranks starting hold serving
        # up), so it waits for that here, while the main thread serves and takes the layers; without the wait a
        # storage.move or peer.restart landed under the async thread's READs, which no simulated run does.
        # The parent serves the next chunk at once while this waits (RealCluster.prepared), instead of first
        # giving the PREPARE its while to build: the layers that end the wait come only with served steps.
        with self.eplb_state:
            waits = self.rebalanced
        if waits:
            self.link.send("prepare_waits", True)
        with self.eplb_state:
            self.eplb_state.wait_for(lambda: not self.rebalanced, timeout=self.cfg.timeout_s)
        if waits:
            self.link.send("prepare_waits", False)
        if storage_move:
            self.retired_buffers.append(self.buffer)
            self.buffer = [torch.full_like(b, float("nan")) for b in self.buffer]
            self.history("storage.move", what="expert_buffer")
        if peer_restart:
            agents = ledger.live_agents()
            for agent in agents:
                agent.restart()
            self.history("peer.restart", agents=[a.name for a in agents])
        comm = self.factory(group, self.weights, self.buffer, self.comm)
        self.prepared_a2a = self._manager(ep_group)  # the standby manager
        if self.prepared_a2a is not None and self._buffers_made_ahead():
            self.prepared_a2a_buffer = self.prepared_a2a.get_handle()  # held by the staged kernels until COMMIT
        self.prepared = (comm, group, spec, ep_group)
        del comm
        self.history("comm.create", gen=spec.name, prev=True)
        self.link.send("prepared", self.pid)

    def do_commit(self) -> None:
        self.join_async()
        # Recorded first, as the simulation does: what this collection finalizes appears after it in the history.
        self.history("gc.collect", reason="commit")
        gc.collect()  # vLLM's switch_and_prepare collects before the swap
        assert self.prepared is not None, "COMMIT without PREPARE"
        comm, group, spec, ep_group = self.prepared
        self.prepared = None
        old, self.comm = self.comm, comm
        self.group, self.group_spec, self.ep_group = group, spec, ep_group
        del comm
        self.history("comm.swap", gen=spec.name)
        self.drop(old, "old communicator")
        del old
        retired = self._switch_all2all() if self.a2a is not None else None
        if self.sc.lifecycle == "0.33.0":  # warm_and_capture releases the graphs again (sim/worker.py)
            self.history("gc.collect", reason="warm_and_capture")
            gc.collect()
        if retired is not None:
            self._start_group_cleanup(retired)

    def do_abort(self) -> None:
        self.join_async()
        if self.prepared is not None:
            self.aborted = self.prepared[0]
            self.prepared = None
        self.history("comm.abort")

    def do_remove(self) -> None:
        """A leaving rank's COMMIT under vLLM 0.33.0 (sim/worker.py's do_remove): wait for an earlier cleanup,
        collect, and destroy the retired all2all managers on the cleanup thread, waiting for it."""
        from sim.all2all import retire_managers

        self.join_async()
        self._wait_for_group_cleanup()
        self.history("gc.collect", reason="remove")
        gc.collect()  # switch_and_remove's _release_cuda_graphs
        for manager in retire_managers(self):
            self._start_group_cleanup(manager)
            self._wait_for_group_cleanup()  # a cleanup that raises is reported as its thread's crash

    def do_exit(self) -> None:
        self.join_async()
        for name in ("prepared", "aborted"):
            value = getattr(self, name)
            setattr(self, name, None)
            if value is not None:
                obj = value[0] if isinstance(value, tuple) else value
                del value
                self.drop(obj, name)
                del obj
        comm, self.comm = self.comm, None
        if comm is not None:
            self.drop(comm, "communicator at exit")
        del comm
        if self.a2a is not None:
            from sim.all2all import shut_down

            self._wait_for_group_cleanup()  # a retired group's destroy still under way
            shut_down(self, self.drop)
        for th in self.gc_threads:
            th.join()
        with self.release_lock:
            self.exiting = True
            self.history("gc.collect", reason="exit")
            gc.collect()  # the interpreter's last collections at exit; gc.never objects are still referenced
            # What the simulation calls a leak: an agent alive now that no GC fault holds on purpose (gc.never, a
            # gc.late still waiting: the simulation finalizes those at interpreter shutdown, before its leak check).
            from . import ledger

            held = ledger.agents_held_only_by(_IMMORTAL + [h for h in self.fault_holders if h])
            self.history("worker.exit", leaked=[a.conn for a in ledger.live_agents() if id(a) not in held])

    # -- dropping a communicator: refcounting, or a GC fault done for real ---------------------------------------
    def drop(self, obj: Any, what: str) -> None:
        """``obj`` just lost its owner's reference; the caller deletes its own name right after."""
        fault = self.gc_faults.get(what)
        how = fault["site"] if fault else "refcount"
        self.history("gc.drop", what=what, how=how)
        if fault is None:
            return  # the caller's `del` is the last reference: finalized right there, on the caller's thread
        holder = [obj]
        del obj
        if how != "gc.cycle":  # a cycle must be the only thing holding it, or no collection could free it
            self.fault_holders.append(holder)
        if how == "gc.late":
            delay = float(fault.get("delay_s", 1.0))
            self.run_thread(f"gc-late@{self.pid}", self._release_later, holder, delay, what)
        elif how == "gc.thread":
            th = self.run_thread(f"eplb-async@{self.pid}", self._release_later, holder, 0.0, what)
            self.gc_threads.append(th)
        elif how == "gc.cycle":
            holder.append(holder)  # only a collection frees it: the next gc.collect() (commit, exit)
            del holder
        elif how == "gc.never":
            _IMMORTAL.append(holder)

    def _release_later(self, holder: list, delay: float, what: str) -> None:
        if delay > 0:
            time.sleep(delay)
        with self.release_lock:  # see __init__: never while exit's leak check looks
            if self.exiting:
                return
            self.history("gc.finalize", what=what, how="released")
            holder.clear()  # the last reference: the finalizer runs on this thread, now


DEEP_EP_LEAK_WARNING = "destroy() was not called before DeepEP buffer destruction"


def watch_deep_ep_warnings(link: Link, pid: int) -> None:
    """DeepEP's destructor of a buffer made with ``explicitly_destroy=True`` and never destroyed prints a warning
    with C's ``printf`` and returns (the buffer leaks).  That line is the only sign of it, so this process's file
    descriptor 1 goes through a pipe: each such line becomes a ``deep_ep.leak`` event (the simulation's fake records
    the same event where it prints the same warning); every line goes on to the real stdout."""
    sys.stdout.flush()
    real_stdout = os.dup(1)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)

    def pump() -> None:
        with os.fdopen(read_end, "rb") as lines, os.fdopen(real_stdout, "wb", buffering=0) as out:
            for line in lines:
                if DEEP_EP_LEAK_WARNING.encode() in line:
                    link.emit("deep_ep.leak", pid=pid, team="a buffer (DeepEP's warning names none)")
                out.write(line)

    threading.Thread(target=pump, name=f"stdout@{pid}", daemon=True).start()


def report_crash(link: Link, pid: int, thread: str, exc: BaseException) -> None:
    try:  # the chain and the frames as data, as the simulation keeps them (sim/crash.py), for the verdict
        from sim.crash import describe

        crash = describe(exc, thread, pid)
    except Exception:  # noqa: BLE001 - the crash is reported all the same, with its traceback's text
        crash = None
    link.emit(
        "thread.crash",
        pid=pid,
        thread=thread,
        type=type(exc).__name__,
        error=str(exc).splitlines()[0] if str(exc) else "",
        traceback="".join(traceback.format_exception(exc))[-4000:],
        crash=crash,
    )
    link.send("crash", pid)


def rank_main(conn, cfg: RankConfig) -> None:
    """The rank process: set up, then run the parent's commands until ``exit``."""
    if cfg.parent is not None:
        _die_with_parent(cfg.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C goes to the parent, which stops every rank itself
    link = Link(conn, cfg.pid)
    gc.disable()  # collections happen where vLLM makes them (commit) and at exit, never at random
    try:
        from . import ledger

        ledger.install(link.emit, cfg.pid)
        if cfg.scenario.get("all2all", {}).get("backend", "none") != "none":
            watch_deep_ep_warnings(link, cfg.pid)
        worker = RealWorker(cfg, link)
    except BaseException as exc:  # noqa: BLE001 - a rank that cannot start is reported, not a traceback
        report_crash(link, cfg.pid, f"setup@{cfg.pid}", exc)
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the parent went away
        if msg[0] == "kill":  # fail_rank on a torchrun slot: the engine cannot signal another host's process.
            # Ended at once, no finalizer or atexit runs, the kernel closes its sockets: to its peers what a SIGKILL
            # is.  Exit status 0, because torchrun tears every slot down when one fails, the engine's included.
            os._exit(0)
        _, cmd_id, kind, args, step, gc_faults = msg
        worker.step, worker.gc_faults = step, gc_faults
        try:
            result = getattr(worker, f"do_{kind}")(**args)
        except BaseException as exc:  # noqa: BLE001 - the code under test raised: a crash, reported
            report_crash(link, cfg.pid, f"worker@{cfg.pid}", exc)
            continue
        link.send("done", cmd_id, result)
        if kind == "exit":
            break
    del worker
    sys.stdout.flush()


if __name__ == "__main__":
    from multiprocessing.connection import Connection

    _conn = Connection(int(sys.argv[1]))
    rank_main(_conn, _conn.recv())
