"""``epsim calibrate``: measure the real backend's timing, hand it to the simulation, and say how far apart they are.

Measured on this host:

- with 2, 3, ... processes loaded as ranks are, all at once (``real_backends/host_load.py``): an agent's creation,
  a registration, the remote setup, layer-like rounds of READs and a barrier (fitted as ``latency + k * post +
  k * bytes / bandwidth``), a collective and a full ``gc.collect()``.  The simulation charges each cost at the
  number of rank processes alive (``Calibration.costs``): on a host with fewer cores than busy threads, every one
  grows with them;
- between two processes, as before: READ time against size through the EPLB communicator's calls (64 KiB to
  64 MiB, fitted by relative error), a one-float gloo ``all_reduce``, a rank process's start-up from a fresh
  interpreter, four READs posted together against four single ones, and a ``gc.collect()`` alone.  They are
  recorded and used only by a calibration without the rows above.

Then the comparison: scenarios of several sizes (ranks, layers, expert row sizes), none of them used by the fits,
run on the real backend and in the simulation with the calibration; every rebalance, each reconfiguration and
each of its phases is timed in both worlds, and the summary gives the median error of each kind.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import platform
import statistics
import time
from typing import Any, Callable

from sim.calibration import Calibration, HostLoad, fit

from .nixl_real import progress_delay_us

COLLECTIVE_REPEATS = 200
ROW_FLOATS = 1 << 18  # 1 MiB expert rows in the comparison scenario (2 tensors: 2 MiB per expert)


def _collective_peer(port: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from .groups import GroupSpec, connect_store, open_group

    from .nixl_real import import_real_nixl

    agent = import_real_nixl()[0].nixl_agent("calibrate-peer")  # noqa: F841 - alive, as in a rank: its threads run
    group = open_group(connect_store("127.0.0.1", port, 60), GroupSpec("calibrate", 1, 2), 60)
    for _ in range(repeats + 10):
        dist.all_reduce(torch.zeros(1), group=group)


def measure_collective(repeats: int = COLLECTIVE_REPEATS) -> float:
    """Median seconds of a one-float gloo all_reduce between two processes on loopback."""
    import torch
    import torch.distributed as dist
    from torch.distributed import TCPStore

    from .cluster import LOOPBACK_ENV
    from .groups import GroupSpec, open_group

    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_ENV["GLOO_SOCKET_IFNAME"])
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    peer = mp.get_context("spawn").Process(target=_collective_peer, args=(store.port, repeats), daemon=True)
    peer.start()
    try:
        from .nixl_real import import_real_nixl

        agent = import_real_nixl()[0].nixl_agent("calibrate-self")  # noqa: F841 - alive, as in a rank
        group = open_group(store, GroupSpec("calibrate", 0, 2), 60)
        t = torch.zeros(1)
        for _ in range(10):
            dist.all_reduce(t, group=group)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            dist.all_reduce(t, group=group)
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    finally:
        peer.join(30)
        if peer.is_alive():
            peer.kill()


def _starter(conn) -> None:
    import torch  # noqa: F401 - what a rank imports before it can serve

    from .nixl_real import import_real_nixl

    api, _, _ = import_real_nixl()
    api.nixl_agent("calibrate-start")
    conn.send("ready")


def _collector(conn, repeats: int) -> None:
    """A process loaded as a rank is (torch, NIXL with an agent, epsim's real backend and simulator modules): the
    median time of a full ``gc.collect()`` there."""
    import gc

    import torch  # noqa: F401 - what a rank holds

    from sim import cluster, engine  # noqa: F401
    from . import rank  # noqa: F401
    from .nixl_real import import_real_nixl

    api, _, _ = import_real_nixl()
    agent = api.nixl_agent("calibrate-collect")  # noqa: F841 - alive while collecting, as a rank's are
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - started)
    conn.send(statistics.median(times))


def measure_collect(repeats: int = 5) -> float:
    """Median seconds of a planned ``gc.collect()`` in a process loaded as a rank is: vLLM collects once at COMMIT
    (twice in 0.33.0), and on a real rank that is most of the COMMIT's time."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_collector, args=(child, repeats), daemon=True)
    proc.start()
    try:
        return float(conn.recv()) if conn.poll(180) else float("nan")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def measure_process_start(repeats: int = 3) -> float:
    """Median seconds from starting a process to an agent in it (imports included)."""
    ctx = mp.get_context("spawn")
    times = []
    for _ in range(repeats):
        conn, child = ctx.Pipe()
        started = time.perf_counter()
        proc = ctx.Process(target=_starter, args=(child,), daemon=True)
        proc.start()
        if conn.poll(120):
            conn.recv()
            times.append(time.perf_counter() - started)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return statistics.median(times) if times else float("nan")


# What each measurement takes: in full, and with ``--quick`` (a smoke test of the whole path, as CI and a GPU job's
# first minute want it: about half the time on a 2-core machine, too few samples to trust the numbers).
KIB = 1 << 10
FULL: dict[str, Any] = {
    "sizes_mib": (1 / 16, 1 / 4, 1, 4, 16, 64),
    "repeats": 9,
    "collectives": COLLECTIVE_REPEATS,
    "starts": 3,
    "share_mib": 4,
    "share_repeats": 5,
    "collects": 7,
    "load": {
        "ranks": (2, 3, 4),
        "row_bytes": (256 * KIB, 1024 * KIB, 4096 * KIB),
        "reads": (1, 2, 4),
        "repeats": 7,
        "collects": 3,
    },
    "fit_runs": 3,
}
QUICK: dict[str, Any] = {
    "sizes_mib": (1 / 16, 1, 16),
    "repeats": 3,
    "collectives": 50,
    "starts": 1,
    "share_mib": 1,
    "share_repeats": 3,
    "collects": 3,
    "load": {"ranks": (2, 3), "row_bytes": (256 * KIB, 1024 * KIB), "reads": (1, 2), "repeats": 3, "collects": 1},
    "fit_runs": 1,
}


def _finite(seconds: float) -> float:
    """A measurement that did not come (nan) counts as none."""
    return seconds if seconds == seconds else 0.0


def _quiet(message: str) -> None:
    pass


def measure(device: str = "cpu", quick: bool = False, progress: Callable[[str], None] = _quiet) -> Calibration:
    """The calibration of this host; ``progress`` hears each step as it starts (a full run takes minutes)."""
    from . import transfers

    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # the helper processes' INFO lines would land on stdout
    how = QUICK if quick else FULL
    progress(f"READs between two agents, {len(how['sizes_mib'])} sizes")
    reads = transfers.measure(sizes_mib=how["sizes_mib"], repeats=how["repeats"], device=device, prep_each=True)
    points = [(v["bytes"], v["nixl_s"]) for v in reads["sizes"].values()]
    latency, bandwidth = fit(points)
    # Every size loads the peer afresh: its first READ over a steady one is the connection's cost.
    connect = statistics.median(max(0.0, v["first_s"] - v["nixl_s"]) for v in reads["sizes"].values())
    progress("collectives, process starts, collections, concurrent READs")
    measured = Calibration(
        xfer_latency_s=latency,
        bandwidth_Bps=bandwidth,
        connect_s=connect,
        collective_latency_s=measure_collective(how["collectives"]),
        process_start_s=measure_process_start(how["starts"]),
        collect_s=_finite(measure_collect(how["collects"])),
        concurrent_share=measure_concurrent_share(device, mib=how["share_mib"], repeats=how["share_repeats"]),
        quick=quick,
        device=device,
        memory=reads["memory"],
        progress_delay_us=progress_delay_us(),
        loaded=measure_loaded(how["load"], device, progress),
        nixl=reads["package"],
        host=platform.node(),
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        points=[{"bytes": b, "seconds": t} for b, t in points],
    )
    progress(f"fitting the stall on {how['fit_runs']} real runs of {FIT_CASE[0]} {FIT_CASE[2]}->{FIT_CASE[3]}")
    return fit_stalls(measured, device, repeats=how["fit_runs"])[0]


def measure_loaded(
    plan: dict[str, Any], device: str = "cpu", progress: Callable[[str], None] = _quiet
) -> list[HostLoad]:
    """A :class:`HostLoad` row for each number of rank processes in ``plan["ranks"]``."""
    from . import host_load

    rows = []
    for n in plan["ranks"]:
        progress(f"the host loaded as {n} ranks")
        got = host_load.measure(n, {**plan, "device": device})
        latency, post, bandwidth = host_load.fit_rounds(got["rounds"], got["collective_s"])
        copy_latency, copy_bandwidth = fit(got["copies"])
        rows.append(
            {
                **{k: v for k, v in got.items() if k not in ("rounds", "copies")},
                "xfer_latency_s": latency,
                "post_s": post,
                "bandwidth_Bps": bandwidth,
                "copy_latency_s": copy_latency,
                "copy_Bps": copy_bandwidth,
                "rounds": [list(r) for r in got["rounds"]],
            }
        )
    # With two processes an agent loads one peer: its later add_remote_agent takes the rows that measured one.
    later = [r["remote_setup_s"] for r in rows if r["remote_setup_s"] is not None]
    for r in rows:
        if r["remote_setup_s"] is None:
            r["remote_setup_s"] = statistics.median(later) if later else r["first_remote_setup_s"]
    return [HostLoad(**r) for r in rows]


def measure_concurrent_share(device: str = "cpu", k: int = 4, mib: float = 4, repeats: int = 5) -> float:
    """k READs of ``mib`` posted together by one process over k single READs (median times)."""
    from . import concurrent_reads

    return concurrent_reads.measure(device, k, (mib,), repeats)["sizes"][f"{mib:g}MiB"]["together_over_k_one"]


# The comparison's scenarios: (built-in scenario, strategy, ranks, target size, layers, expert row bytes).  The first
# is the fitting run (each rank count's stall_s is fitted on its rebalances); the others are judged on sizes and row
# sizes no fit saw, 4 ranks among them (its stall_s extrapolated).  per-communicator-agent on the scale-down: it is
# the strategy that passes there (the others keep a departed rank's agent as a peer), and it makes an agent per
# communicator.  The abort (vLLM PR #53947's lifecycle, the scenario's own) is followed by a scale-up to 4.
FIT_CASE = ("scale-up", "shared-agent", 2, 3, 4, 1 << 20)
COMPARISONS = (
    ("scale-up", "shared-agent", 2, 4, 2, 256 * KIB),
    ("scale-up", "shared-agent", 3, 4, 8, 1 << 20),
    ("scale-down", "per-communicator-agent", 3, 2, 4, 1 << 20),
    ("scale-up", "per-communicator-agent", 2, 3, 1, 4 << 20),
    ("abort", "shared-agent", 2, 4, 2, 1 << 20),
)
QUICK_COMPARISONS = COMPARISONS[:1]


def comparison_scenario(
    name: str = "scale-up", ranks: int = 2, to: int = 3, layers: int = 4, row_bytes: int = ROW_FLOATS * 4
):
    """``name`` from ``ranks`` to ``to`` ranks with ``layers`` layers and expert rows of ``row_bytes`` (per weight
    tensor): the nominal size is the real one, so both worlds move the same bytes."""
    from sim import scenario as scenario_mod

    sc = scenario_mod.load(name)
    return scenario_mod.with_overrides(
        sc,
        **{
            "ranks": ranks,
            "timeline.0.to": to,
            "max_ranks": max(ranks, to),
            "model.layers": layers,
            "model.hidden": row_bytes // 4,
            "model.nominal_expert_bytes": row_bytes * sc.model.tensors_per_layer,
        },
    )


def as_real_runs(sc):
    """The scenario as the real backend runs it: its ranks serve without taking time (a rebalance's steps aside),
    so a PREPARE lasts as long as building takes.  The simulation gets the same: steps of 0.1 ms and no fixed
    ``prepare_s``, so the build's own costs decide PREPARE in both worlds."""
    from sim import scenario as scenario_mod

    over = {"serving.step_time_s": 1e-3}
    over.update({f"timeline.{i}.prepare_s": 0.0 for i in range(len(sc.timeline))})
    return scenario_mod.with_overrides(sc, **over)


def compare_one(calibration: Calibration, case: tuple, device: str = "cpu", timeout_s: float = 300.0) -> dict[str, Any]:
    """Simulated against measured time of each rebalance and reconfiguration (and its phases) of one case."""
    from sim.run import run_scenario

    from .run import run_real
    from .validate import predicted_profile

    name, strategy, ranks, to, layers, row_bytes = case
    sc = comparison_scenario(name, ranks, to, layers, row_bytes)
    profile = predicted_profile(device)
    sim = run_scenario(as_real_runs(sc), strategy=strategy, profile=profile, calibration=calibration)
    real = run_real(sc, strategy=strategy, device=device, timeout_s=timeout_s)
    rows = []
    # The n-th span of a kind in one world against the n-th of that kind in the other: the worlds may serve a few
    # steps more or less while a PREPARE builds, and so make one rebalance more or less at the end; a run that
    # failed or stopped early has fewer.  The comparison says when the counts differ instead of ending silently.
    seen: dict[str, int] = {}
    measured_of: dict[tuple[str, int], float] = {}
    for what, c, d in real.spans:
        measured_of[(what, seen.get(what, 0))] = d - c
        seen[what] = seen.get(what, 0) + 1
    seen.clear()
    for what, a, b in sim.spans:
        key = (what, seen.get(what, 0))
        seen[what] = key[1] + 1
        if key not in measured_of:
            continue
        simulated, measured = b - a, measured_of[key]
        rows.append(
            {
                "what": what,
                "simulated_s": round(simulated, 6),
                "measured_s": round(measured, 6),
                "error": round((simulated - measured) / measured, 3) if measured > 0 else None,
            }
        )
    complete = len(rows) == len(sim.spans) == len(real.spans) and sim.verdict == real.verdict == "pass"
    kib = row_bytes >> 10
    rows_label = f"{kib >> 10} MiB" if kib >= 1024 else f"{kib} KiB"
    return {
        "scenario": f"{name} {ranks}->{to}, {layers} layers, {rows_label} expert rows, {strategy}",
        "sim_verdict": sim.verdict,
        "real_verdict": real.verdict,
        "real_detail": real.detail,
        "complete": complete,
        "spans_simulated": len(sim.spans),
        "spans_measured": len(real.spans),
        "spans": rows,
    }


def _rebalances(spans) -> list[float]:
    """Seconds of each plain rebalance (not a reshuffle), in order."""
    return [b - a for what, a, b in spans if what == "rebalance"]


def fit_stalls(
    calibration: Calibration, device: str = "cpu", case: tuple = FIT_CASE, timeout_s: float = 300.0, repeats: int = 3
) -> tuple[Calibration, dict[str, Any]]:
    """Fit ``stall_s`` on ``repeats`` real runs of ``case``: ``stall_s = ranks * s``, the one ``s`` that makes the
    median error of the simulated rebalances against the measured ones zero (bisection: the simulation is
    deterministic and its rebalances grow with ``s``).  Proportional to the ranks, because the wait is for the last
    rank the scheduler lets run, which grows with the ranks that share the cores; one coefficient, because two noisy
    rank counts are no line to extrapolate along; several runs, because one run's rebalances on a small host vary
    by a third from run to run.  Returns the calibration with every row's stall_s, and what the fit saw."""
    from sim.run import run_scenario

    from .run import run_real
    from .validate import predicted_profile

    name, strategy, ranks, to, layers, row_bytes = case
    sc = comparison_scenario(name, ranks, to, layers, row_bytes)
    runs = []
    for _ in range(repeats):
        real = run_real(sc, strategy=strategy, device=device, timeout_s=timeout_s)
        if real.verdict != "pass":
            raise RuntimeError(
                f"a fitting run ({name} {ranks}->{to}) did not pass on the real backend: "
                f"{real.verdict} {real.detail or ''}".strip()
            )
        runs.append(_rebalances(real.spans))

    def with_stall(per_rank: float) -> Calibration:
        return calibration.model_copy(
            update={"loaded": [r.model_copy(update={"stall_s": r.ranks * per_rank}) for r in calibration.loaded]}
        )

    def error(per_rank: float) -> float:
        sim = run_scenario(
            as_real_runs(sc), strategy=strategy, profile=predicted_profile(device), calibration=with_stall(per_rank)
        )
        simulated = _rebalances(sim.spans)
        return statistics.median(a / b - 1 for measured in runs for a, b in zip(simulated, measured) if b > 0)

    lo, hi = 0.0, 0.002
    if not any(runs) or error(lo) >= 0:
        hi = 0.0
    else:
        while error(hi) < 0 and hi < 1.0:
            lo, hi = hi, hi * 4
        for _ in range(12):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if error(mid) < 0 else (lo, mid)
    per_rank = (lo + hi) / 2
    label = f"{name} {ranks}->{to}, {layers} layers, {row_bytes >> 10} KiB expert rows, {strategy}"
    return with_stall(per_rank).model_copy(update={"fitted_on": label}), {
        "case": label,
        "stall_per_rank_s": per_rank,
        "measured_rebalance_s": [[round(v, 6) for v in measured] for measured in runs],
    }


def compare(
    calibration: Calibration,
    device: str = "cpu",
    timeout_s: float = 300.0,
    cases: tuple = COMPARISONS,
    progress: Callable[[str], None] = _quiet,
) -> dict[str, Any]:
    """Every case of :func:`compare_one` and, first, the fitting run's own case (``fitted``: its rebalances decided
    stall_s, so it says how well the fit took, not how well the model predicts); the median error of each kind of
    span over the judged runs, and over the fitted one apart."""
    runs = []
    for i, case in enumerate((FIT_CASE, *cases)):
        name, _, ranks, to, layers, row_bytes = case
        progress(
            f"comparing {i + 1}/{len(cases) + 1}: {name} {ranks}->{to}, {layers} layers, "
            f"{row_bytes >> 10} KiB rows, in both worlds"
        )
        runs.append({**compare_one(calibration, case, device, timeout_s), "fitted": i == 0})

    def summary(chosen: list[dict[str, Any]]) -> dict[str, Any]:
        out = {}
        for kind in sorted({r["what"] for run in chosen for r in run["spans"]}):
            errors = [
                r["error"] for run in chosen for r in run["spans"] if r["what"] == kind and r["error"] is not None
            ]
            if errors:
                median = statistics.median(errors)
                out[kind] = {"count": len(errors), "median_error": round(median, 3), "within_25%": abs(median) <= 0.25}
        return out

    return {
        "runs": runs,
        "complete": all(r["complete"] for r in runs),
        "fitted_on": calibration.fitted_on,
        "summary": summary([r for r in runs if not r["fitted"]]),
        "fitted_summary": summary([r for r in runs if r["fitted"]]),
    }
