"""``epsim calibrate``: measure the real backend's timing, hand it to the simulation, and say how far apart they are.

Measured, between two processes on this host as ranks are:

- READ time against size (64 KiB to expert-sized 64 MiB; host memory, or VRAM with ``--device cuda``) through
  the EPLB communicator's calls (descriptor lists prepared, the READ posted and polled to DONE, everything
  released): fitted as ``latency + bytes / bandwidth`` (the simulation's transfer time model), by relative error;
  the first READ after loading a peer, over a steady one, is the connection cost (``connect_s``);
- a gloo ``all_reduce`` of one float on loopback between two processes that each hold a NIXL agent (its progress
  thread competes for the cores, as in a rank): the barrier every layer's ``execute()`` ends with;
- a rank process's start-up until it can take commands (imports, an agent): informational;
- four READs of 4 MiB posted together against four single READs (``benchmarks/concurrent_reads.py``): near 1 when
  a process's READs share its bandwidth, as the simulation models them, near 1/4 if each had all of it;
  informational.

Then the comparison: one scenario (scale-up 2->3 with 1 MiB expert rows, so every READ moves real expert-sized
bytes) runs on the real backend and in the simulation with the calibration; each rebalance and the
reconfiguration are timed in both worlds and the relative error of the simulated time is reported.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import platform
import statistics
import time
from typing import Any

from sim.calibration import Calibration, fit

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
FULL = {"sizes_mib": (1 / 16, 1 / 4, 1, 4, 16, 64), "repeats": 9, "collectives": COLLECTIVE_REPEATS, "starts": 3,
        "share_mib": 4, "share_repeats": 5, "collects": 7}
QUICK = {"sizes_mib": (1 / 16, 1, 16), "repeats": 3, "collectives": 50, "starts": 1, "share_mib": 1,
         "share_repeats": 3, "collects": 3}


def _finite(seconds: float) -> float:
    """A measurement that did not come (nan) counts as none."""
    return seconds if seconds == seconds else 0.0


def measure(device: str = "cpu", quick: bool = False) -> Calibration:
    from benchmarks import transfers

    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # the helper processes' INFO lines would land on stdout
    how = QUICK if quick else FULL
    reads = transfers.measure(sizes_mib=how["sizes_mib"], repeats=how["repeats"], device=device, prep_each=True)
    points = [(v["bytes"], v["nixl_s"]) for v in reads["sizes"].values()]
    latency, bandwidth = fit(points)
    # Every size loads the peer afresh: its first READ over a steady one is the connection's cost.
    connect = statistics.median(max(0.0, v["first_s"] - v["nixl_s"]) for v in reads["sizes"].values())
    return Calibration(xfer_latency_s=latency, bandwidth_Bps=bandwidth, connect_s=connect,
                       collective_latency_s=measure_collective(how["collectives"]),
                       process_start_s=measure_process_start(how["starts"]),
                       collect_s=_finite(measure_collect(how["collects"])),
                       concurrent_share=measure_concurrent_share(device, mib=how["share_mib"],
                                                                 repeats=how["share_repeats"]),
                       quick=quick, device=device, memory=reads["memory"],
                       nixl=reads["package"], host=platform.node(),
                       measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       points=[{"bytes": b, "seconds": t} for b, t in points])


def measure_concurrent_share(device: str = "cpu", k: int = 4, mib: float = 4, repeats: int = 5) -> float:
    """k READs of ``mib`` posted together by one process over k single READs (median times)."""
    from benchmarks import concurrent_reads

    return concurrent_reads.measure(device, k, (mib,), repeats)["sizes"][f"{mib:g}MiB"]["together_over_k_one"]


def comparison_scenario():
    """scale-up 2->3 with 1 MiB expert rows: the nominal size is the real one, so both worlds move the same bytes."""
    from sim import scenario as scenario_mod

    sc = scenario_mod.load("scale-up")
    return scenario_mod.with_overrides(sc, **{
        "timeline.0.to": 3, "max_ranks": 3, "model.hidden": ROW_FLOATS,
        "model.nominal_expert_bytes": ROW_FLOATS * 4 * sc.model.tensors_per_layer})


def compare(calibration: Calibration, device: str = "cpu", timeout_s: float = 300.0) -> dict[str, Any]:
    """Simulated against measured time of each rebalance and reconfiguration of :func:`comparison_scenario`."""
    from sim.run import run_scenario

    from .run import run_real

    sc = comparison_scenario()
    profile = "cuda" if device == "cuda" else "dram"
    sim = run_scenario(sc, strategy="shared-agent", profile=profile, calibration=calibration)
    real = run_real(sc, strategy="shared-agent", device=device, timeout_s=timeout_s)
    rows = []
    # Spans are compared in order while both runs did the same thing; where they part (a run failed or stopped
    # early), the comparison says so instead of ending silently.
    for (what, a, b), (what_r, c, d) in zip(sim.spans, real.spans):
        if what != what_r:
            break
        simulated, measured = b - a, d - c
        rows.append({"what": what, "simulated_s": round(simulated, 6), "measured_s": round(measured, 6),
                     "error": round((simulated - measured) / measured, 3) if measured > 0 else None})
    summary = {}
    for kind in sorted({r["what"] for r in rows}):
        errors = [r["error"] for r in rows if r["what"] == kind and r["error"] is not None]
        if errors:
            summary[kind] = {"count": len(errors), "median_error": round(statistics.median(errors), 3)}
    complete = len(rows) == len(sim.spans) == len(real.spans) and sim.verdict == real.verdict == "pass"
    return {"scenario": f"{sc.name} 2->3, {ROW_FLOATS * 4 >> 20} MiB expert rows", "sim_verdict": sim.verdict,
            "real_verdict": real.verdict, "real_detail": real.detail, "complete": complete,
            "spans_simulated": len(sim.spans), "spans_measured": len(real.spans), "spans": rows,
            "summary": summary}
