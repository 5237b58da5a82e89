"""What each cost the simulation models is on a host running ``n`` rank processes at once.

On a host with fewer cores than busy threads (every rank polls its READs; NIXL's progress thread spins unless
``EPSIM_NIXL_PROGRESS_DELAY_US`` says otherwise), every cost grows with the number of rank processes: a READ, a
collective, a full ``gc.collect()``. Measured one at a time between two idle processes they add up to a tenth or
less of what a real rebalance takes on a 2-core host. So ``epsim calibrate`` starts ``n`` processes loaded as ranks
are (torch, NIXL with an agent, epsim's modules; each rank's progress-thread setting) for each ``n`` and measures,
in all of them at once, as ranks do it, through the registration ledger a real rank's agents have (each call it
records is an event sent to the parent, which the real backend's own times include):

- an agent's creation (the first in a process loads UCX's transports), a memory registration, and a group's
  opening with every member there;
- the remote setup: ``add_remote_agent`` of each peer once the metadata is gathered (an agent's first peer costs
  more than the later ones);
- rounds as a layer of a rebalance is: every member READs ``k`` experts of ``b`` bytes from its neighbour (each a
  READ of one descriptor per weight tensor, prepared, posted, polled to DONE and released), then an ``all_reduce``
  barrier; and rounds with the barrier alone (the collective's cost);
- the metadata ``all_gather_object`` with every member there (an object collective: pickling and two
  collectives), and row copies in host memory as ``move_from_buffer`` makes them;
- a ``gc.collect()`` in every member at once, as every rank collects at COMMIT;
- a command sent to every member in turn (how far apart it reaches them), and each member's exit: its agent
  dropped, a last collection, then the process's end (the interpreter's teardown, with torch and NIXL loaded).

:func:`fit_rounds` turns the rounds into the simulation's transfer model for that ``n``: ``round - collective =
xfer_latency + k * post + k * b / bandwidth``.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import queue
import statistics
import threading
import time
from typing import Any

DESCS_PER_READ = 2  # as the scenarios' experts: one descriptor per weight tensor of the layer


def _member(rank: int, n: int, port: int, plan: dict[str, Any], conn, events) -> None:
    """One of the ``n`` processes: everything it measured goes back over ``conn`` (or the error, as a string);
    the ledger's events go to ``events``, which the parent drains as it drains a rank's."""
    lock = threading.Lock()

    def emit(kind: str, **fields: Any) -> None:
        with lock:  # as a rank's link: one sender at a time
            events.send(("event", time.monotonic(), rank, kind, fields))

    try:
        out, held = _measure_member(rank, n, port, plan, emit)
        conn.send(out)
        # Commands from the parent, answered with the time each arrived: how far apart a command sent to every
        # rank in turn reaches them.  Then the exit, as a rank's: its agent dropped, a last collection, the end.
        while conn.recv() == "ping":  # then "exit"
            conn.send(time.monotonic())
        held.clear()
        gc.collect()
        conn.send("bye")
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which says which member failed
        conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        events.send(None)


def _measure_member(rank: int, n: int, port: int, plan: dict[str, Any], emit) -> tuple[dict[str, Any], list]:
    """What this member measured, and what it holds as a rank would until its exit (its agent and tensors)."""
    import torch
    import torch.distributed as dist

    # Loaded as a rank is: a full collection traverses these modules' objects too.
    from sim import cluster, engine  # noqa: F401
    from . import rank as _rank  # noqa: F401
    from . import ledger
    from .groups import GroupSpec, connect_store, open_group
    from .nixl_real import import_real_nixl

    torch.set_num_threads(1)
    api, _, _ = import_real_nixl()
    ledger.install(emit, rank)  # and the rank's progress-thread setting
    out: dict[str, Any] = {}

    started = time.perf_counter()
    agent = api.nixl_agent(f"host-load-{rank}")
    out["first_agent_s"] = time.perf_counter() - started
    started = time.perf_counter()
    spare = api.nixl_agent(f"host-load-{rank}-spare")
    out["agent_s"] = time.perf_counter() - started
    del spare

    row_floats = max(plan["row_bytes"]) // 4 // DESCS_PER_READ
    k_max = max(plan["reads"])
    # DESCS_PER_READ tensors of k_max expert rows, and a receive buffer as large: a layer's weights as a rank has them
    # (host memory, or VRAM of GPU 0, which every member shares as the real backend's ranks on one GPU do).
    cuda = plan.get("device", "cpu") == "cuda"
    where, mem = ("cuda:0", "VRAM") if cuda else ("cpu", "DRAM")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    weights = [torch.full((k_max, row_floats), float(rank + 1), device=where) for _ in range(DESCS_PER_READ)]
    buffers = [torch.zeros(k_max, row_floats, device=where) for _ in range(DESCS_PER_READ)]
    started = time.perf_counter()
    registered = [agent.register_memory(t) for t in weights + buffers]
    out["register_s"] = (time.perf_counter() - started) / len(registered)

    store = connect_store("127.0.0.1", port, 120)
    group = open_group(store, GroupSpec("host-load", rank, n), 120)
    barrier = torch.zeros(1)
    dist.all_reduce(barrier, group=group)
    # A group opened with every member there, as a reconfiguration's new one (gloo connects a full mesh).
    started = time.perf_counter()
    spare_group = open_group(store, GroupSpec("host-load-again", rank, n), 120)
    out["group_s"] = time.perf_counter() - started
    del spare_group

    # Remote setup, as a communicator does it on its first use.
    metadata: list[Any] = [None] * n
    dist.all_gather_object(metadata, agent.get_agent_metadata(), group=group)
    names, setup = {}, []
    for r in sorted(range(n), key=lambda r: (r - rank) % n)[1:]:  # each member loads a different peer first
        started = time.perf_counter()
        names[r] = agent.add_remote_agent(metadata[r])
        setup.append(time.perf_counter() - started)
    out["first_remote_setup_s"] = setup[0]
    out["remote_setup_s"] = statistics.median(setup[1:]) if len(setup) > 1 else None
    bases: list[Any] = [None] * n
    dist.all_gather_object(bases, [t.data_ptr() for t in weights], group=group)
    src = (rank + 1) % n

    barriers: list[tuple[float, float]] = []  # (arrived, left) of each round's barrier, on the host's clock

    def one_round(k: int, nbytes: int) -> float:
        """k READs of nbytes from the neighbour, polled to DONE and released, then the barrier (seconds)."""
        part = nbytes // DESCS_PER_READ
        started = time.perf_counter()
        xfers, dlists = [], []
        for row in range(k):
            local = agent.get_xfer_descs([(b.data_ptr() + row * b.stride(0) * 4, part, 0) for b in buffers], mem)
            remote = agent.get_xfer_descs([(base + row * row_floats * 4, part, 0) for base in bases[src]], mem)
            local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, mem)
            remote_h = agent.prep_xfer_dlist(names[src], remote, mem)
            dlists += [local_h, remote_h]
            indices = list(range(DESCS_PER_READ))
            xfer = agent.make_prepped_xfer("READ", local_h, indices, remote_h, indices)
            xfers.append(xfer)
            agent.transfer(xfer)
        for xfer in xfers:
            while (state := agent.check_xfer_state(xfer)) != "DONE":
                if state != "PROC":
                    raise RuntimeError(f"READ failed: {state}")
        arrived = time.monotonic()
        dist.all_reduce(barrier, group=group)
        barriers.append((arrived, time.monotonic()))
        elapsed = time.perf_counter() - started
        for xfer in xfers:
            agent.release_xfer_handle(xfer)
        for handle in dlists:
            agent.release_dlist_handle(handle)
        return elapsed

    # The first READ towards the peer wires its endpoint up: that round over a steady one is the connection's cost.
    first = one_round(1, min(plan["row_bytes"]))
    steady = statistics.median(one_round(1, min(plan["row_bytes"])) for _ in range(5))
    out["connect_s"] = max(0.0, first - steady)

    # The metadata gather again, every member there first: what the object collective costs, not who came last.
    gathers = []
    for _ in range(3):
        dist.all_reduce(barrier, group=group)
        started = time.perf_counter()
        dist.all_gather_object(metadata, agent.get_agent_metadata(), group=group)
        gathers.append(time.perf_counter() - started)
    out["gather_s"] = statistics.median(gathers)

    # Row copies in host memory, as move_from_buffer makes them: one row of one weight tensor at a time, each time
    # another row and tensor (the same row again would come from the cache, which a rebalance's rows do not).
    copies, turn = [], 0
    for _ in range(plan["repeats"]):
        for nbytes in plan["row_bytes"]:
            part = nbytes // DESCS_PER_READ // 4
            t, row = turn % DESCS_PER_READ, (turn // DESCS_PER_READ) % k_max
            turn += 1
            sync()
            started = time.perf_counter()
            buffers[t][row, :part].copy_(weights[t][row, :part])
            sync()
            copies.append((part * 4, time.perf_counter() - started))
    out["copies"] = copies

    collective = []
    for _ in range(plan["repeats"] * 3):
        started = time.perf_counter()
        dist.all_reduce(barrier, group=group)
        collective.append(time.perf_counter() - started)
    out["collective_s"] = statistics.median(collective)

    rounds = []
    barriers.clear()
    for _ in range(plan["repeats"]):  # the shapes in turns, so that each sees the same host
        for k in plan["reads"]:
            for nbytes in plan["row_bytes"]:
                rounds.append((k, nbytes, one_round(k, nbytes)))
    out["rounds"] = rounds
    out["barriers"] = list(barriers)

    # A collective after the ranks sat idle, as a rebalance's first (its load all_reduce) comes after serving.
    cold = []
    for _ in range(plan["repeats"]):
        time.sleep(0.02)
        arrived = time.monotonic()
        dist.all_reduce(barrier, group=group)
        cold.append((arrived, time.monotonic()))
    out["cold"] = cold

    collects = []
    for _ in range(plan["collects"]):
        dist.all_reduce(barrier, group=group)
        started = time.perf_counter()
        gc.collect()
        collects.append(time.perf_counter() - started)
    out["collect_s"] = statistics.median(collects)
    dist.all_reduce(barrier, group=group)
    for handle in registered:
        agent.deregister_memory(handle)
    return out, [agent, group, weights, buffers]


def measure(n: int, plan: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
    """Every member's measurements with ``n`` processes on this host, combined: the median over members of each
    cost, and every member's rounds."""
    from torch.distributed import TCPStore

    from .cluster import LOOPBACK_ENV

    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    store = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    ctx = mp.get_context("spawn")
    inbox: queue.Queue = queue.Queue()
    members, drains = [], [threading.Thread(target=_handle_events, args=(inbox, n), daemon=True)]
    drains[0].start()
    for rank in range(n):
        mine, theirs = ctx.Pipe()
        events_in, events_out = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_member, args=(rank, n, store.port, plan, theirs, events_out), daemon=True)
        proc.start()
        theirs.close()  # the member's end: a member that dies is then an EOF here, not a wait for ever
        events_out.close()
        members.append((proc, mine))
        drains.append(threading.Thread(target=_drain, args=(events_in, inbox), daemon=True))
        drains[-1].start()
    results: list[Any] = []
    try:
        deadline = time.monotonic() + timeout_s
        for proc, mine in members:
            try:
                got = mine.recv() if mine.poll(max(1.0, deadline - time.monotonic())) else "no answer in time"
            except EOFError:
                proc.join(5)
                got = f"ended without an answer (exit code {proc.exitcode})"
            results.append(got)
        failed = [f"member {rank}: {got}" for rank, got in enumerate(results) if isinstance(got, str)]
        if failed:  # every member's, since the first to fail takes the others' collectives down with it
            raise RuntimeError(f"host load with {n} processes: " + "; ".join(failed))
        command = _command_gap([mine for _, mine in members], plan.get("pings", 5))
        exits = []
        for proc, mine in members:  # one at a time, as a scale-down's departing rank exits while others serve
            mine.send("exit")
            if not mine.poll(timeout_s) or mine.recv() != "bye":
                raise RuntimeError(f"host load with {n} processes: a member did not exit")
            started = time.perf_counter()
            proc.join(timeout_s)
            exits.append(time.perf_counter() - started)
    finally:
        for proc, _ in members:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    combined: dict[str, Any] = {"ranks": n}
    for key in (
        "first_agent_s",
        "agent_s",
        "register_s",
        "gather_s",
        "first_remote_setup_s",
        "remote_setup_s",
        "connect_s",
        "collective_s",
        "collect_s",
        "group_s",
    ):
        values = [r[key] for r in results if r[key] is not None]
        combined[key] = statistics.median(values) if values else None
    combined["barrier_s"] = _last_arrival_to_result([r["barriers"] for r in results])
    combined["cold_collective_s"] = _last_arrival_to_result([r["cold"] for r in results])
    combined["command_s"] = command
    combined["teardown_s"] = statistics.median(exits)
    combined["rounds"] = [row for r in results for row in r["rounds"]]
    combined["copies"] = [row for r in results for row in r["copies"]]
    return combined


def _last_arrival_to_result(per_member: list[list[tuple[float, float]]]) -> float:
    """Median over collectives of the time from the last member's arrival to the first member's result: what the
    collective itself took, without the wait for a late member (one host, one clock)."""
    spans = [min(left for _, left in op) - max(arrived for arrived, _ in op) for op in zip(*per_member)]
    return max(0.0, statistics.median(spans)) if spans else 0.0


def _command_gap(conns, pings: int) -> float:
    """Median seconds between the arrivals of one command sent to every member in turn (each answers with the
    time it arrived; the members' clocks are this host's monotonic clock)."""
    gaps = []
    for _ in range(pings):
        for conn in conns:
            conn.send("ping")
        arrived = [conn.recv() for conn in conns]
        gaps += [b - a for a, b in zip(arrived, arrived[1:])]
    return max(0.0, statistics.median(gaps)) if gaps else 0.0


def _drain(events, inbox: queue.Queue) -> None:
    """The parent's side of a member's ledger, as the real backend's parent reads a rank's events: a reader thread
    that unpickles each and hands it to the thread that records them."""
    try:
        while (item := events.recv()) is not None:
            inbox.put(item)
    except (EOFError, OSError):
        pass
    inbox.put(None)


def _handle_events(inbox: queue.Queue, members: int) -> None:
    """The recording thread (the real parent's main thread): takes every event off the queue, as its ``_pump``."""
    kept, ended = [], 0
    while ended < members:
        item = inbox.get()
        if item is None:
            ended += 1
        else:
            kept.append(item)


def fit_rounds(rounds: list[tuple[int, int, float]], collective_s: float) -> tuple[float, float, float]:
    """(xfer_latency_s, post_s, bandwidth_Bps) of ``round - collective = latency + k*post + k*bytes/bandwidth``,
    by least squares on the relative error over the medians of each (k, bytes) shape; a coefficient the data make
    negative is taken as 0 and the others fitted again without it."""
    import numpy as np

    shapes: dict[tuple[int, int], list[float]] = {}
    for k, nbytes, seconds in rounds:
        shapes.setdefault((int(k), int(nbytes)), []).append(float(seconds))
    rows = [(k, b, max(statistics.median(t) - collective_s, 1e-9)) for (k, b), t in sorted(shapes.items())]
    if len({(k, b) for k, b, _ in rows}) < 3:
        raise ValueError("a fit needs three round shapes or more")
    y = np.array([t for _, _, t in rows])
    full = np.array([[1.0, k, k * b] for k, b, _ in rows]) / y[:, None]
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(full[:, keep], np.ones(len(rows)), rcond=None)
        negative = [i for i, c in zip(keep, coef) if c < 0]
        if not negative or len(keep) == 1:
            break
        keep.remove(negative[0] if negative[0] != 2 or len(negative) == 1 else negative[-1])
    values = dict.fromkeys(range(3), 0.0)
    values.update({i: max(0.0, float(c)) for i, c in zip(keep, coef)})
    per_byte = values[2] if values[2] > 0 else 1e-15
    return values[0], values[1], 1.0 / per_byte
