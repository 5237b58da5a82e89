"""Sweep throughput and time to detect.

Throughput: runs per second of ``scale-up`` seeds through the sweep machinery (engine, results database) on one and
on two local workers, and through a local Ray cluster, against runs of the same scenario in one plain loop; the
three local arms run twice, interleaved (``throughput``).

Time to detect: for each deliberately broken strategy (:mod:`benchmarks.strategies`), swarm seeds of
``elastic-cycle`` are run in order until the broken copy fails on a seed where the careful strategy it was broken
from passes; that count, over several independent seed sequences, gives the median.  The first detected failure of
each sequence is shrunk, and the size of the shrunk schedule (armed faults) is reported.
"""

from __future__ import annotations

import queue
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _plain_loop(specs, answer) -> None:
    from sim.lab.sweep import execute

    started = time.perf_counter()
    for spec in specs:
        execute(spec)
    answer.put(len(specs) / (time.perf_counter() - started))


def _plain(specs) -> float:
    """Runs per second of ``specs`` in one plain loop, in a fresh process like the engines' workers (this one may
    carry the heap of earlier figures, which every planned collection would traverse).  Its start-up is not
    counted: the loop is the baseline, start-up is part of what the machinery costs."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    answer = ctx.Queue()
    proc = ctx.Process(target=_plain_loop, args=(specs, answer))
    proc.start()
    try:
        while True:  # a loop that died (killed, out of memory) must not leave `epsim bench` waiting for ever
            try:
                return answer.get(timeout=5)
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError(
                        f"the plain loop's process ended (exit status {proc.exitcode}) without a result"
                    ) from None
    finally:
        proc.join(timeout=60)


def _through(specs, engine) -> float:
    from sim.lab import resultsdb
    from sim.lab.sweep import run_sweep

    with tempfile.TemporaryDirectory() as tmp, resultsdb.ResultsDB(Path(tmp) / "bench.db") as db:
        started = time.perf_counter()
        out = run_sweep(specs, db, engine, resume=False, bundles_dir=Path(tmp) / "bundles", command="bench")
        assert out.ran == len(specs)
        return len(specs) / (time.perf_counter() - started)


def throughput(quick: bool = False, runs: int | None = None, ray: bool = True) -> dict[str, Any]:
    """Runs per second of each arm (plain loop, one local worker, two local workers), every arm measured twice, in
    the order plain, one, two and then two, one, plain, on fresh seeds each time: this machine's speed drifts by a
    factor of two within an hour (docs/performance.md), and arms run one after the other once each took whatever
    speed their moment had.  ``runs`` per arm and pass (default 1,000; 200 with ``quick``); Ray, when installed and
    ``ray``, once after them."""
    from sim.lab import executors
    from sim.lab.sweep import plan

    # About half a minute of runs per arm and pass: the engines' worker start-up (a second or two of imports) counts
    # as machinery, and a sweep that long already amortises it as longer ones do.  (200 runs were that long until a
    # run stopped scanning the caller's heap at every planned collection and took 35 ms instead of 170.)
    n = runs or (200 if quick else 1000)
    seeds = iter(range(0, 10**9, n))

    def specs():
        first = next(seeds)
        return plan("scale-up", range(first, first + n))

    arms = {
        "plain": lambda: _plain(specs()),
        "local1": lambda: _through(specs(), executors.LocalEngine(1)),
        "local2": lambda: _through(specs(), executors.LocalEngine(2)),
    }
    seconds = dict.fromkeys(arms, 0.0)
    for order in (list(arms), list(reversed(arms))):
        for name in order:
            seconds[name] += n / arms[name]()
    plain, one, two = (2 * n / seconds[name] for name in arms)
    out: dict[str, Any] = {
        "runs": n,
        "passes": 2,
        "plain_runs_per_s": round(plain, 2),
        "local1_runs_per_s": round(one, 2),
        "local2_runs_per_s": round(two, 2),
        "overhead": round(1 - one / plain, 3),
        "parallel_efficiency": round(two / (2 * one), 3),
    }
    if not ray:
        return out
    try:
        ray_engine = executors.RayEngine(workers=2)
    except Exception:  # noqa: BLE001 - Ray is an extra
        out["ray_runs_per_s"] = None
        return out
    try:
        ray_engine.start()
        out["ray_runs_per_s"] = round(_through(specs(), ray_engine), 2)
    finally:
        ray_engine.ray.shutdown()
    return out


def _first_detection(strategy: str, seeds: range) -> tuple[int | None, Any]:
    """(seeds run until detection, the detecting spec) or (None, None) if none in ``seeds`` detects."""
    from benchmarks.strategies import CAREFUL
    from sim.lab.sweep import RunSpec, execute, plan

    template = plan("elastic-cycle", range(1), [strategy], swarm=True)[0]
    for i, seed in enumerate(seeds, 1):
        broken = RunSpec(template.scenario, template.scenario_yaml, seed, strategy, template.profile, (), True)
        row = execute(broken)
        if row["verdict"] == "pass":
            continue
        careful = RunSpec(template.scenario, template.scenario_yaml, seed, CAREFUL, template.profile, (), True)
        if execute(careful)["verdict"] == "pass":
            return i, (broken, row)
    return None, None


def time_to_detect(quick: bool = False) -> dict[str, Any]:
    from benchmarks.strategies import BROKEN
    from sim.lab import bundle, shrink

    trials = 3 if quick else 7
    limit = 60
    out: dict[str, Any] = {}
    for name, strategy in BROKEN.items():
        counts, shrunk = [], None
        for t in range(trials):
            found, detected = _first_detection(strategy, range(10_000 * (t + 1), 10_000 * (t + 1) + limit))
            counts.append(found if found is not None else limit + 1)
            if detected is not None and shrunk is None:
                spec, row = detected
                with tempfile.TemporaryDirectory() as tmp:
                    path = bundle.write(spec, row, Path(tmp))
                    res = shrink.shrink(path, Path(tmp) / "shrunk", max_runs=60)
                    shrunk = {
                        "faults_before": len(row["faults_armed"]),
                        "faults_after": len(res.final.faults),
                        "elastic_events_after": len(res.final.scenario.timeline),
                        "signature": row["signature"],
                    }
        out[name] = {
            "strategy": strategy,
            "seeds_to_detect": counts,
            "median": statistics.median(counts),
            "limit": limit,
            "shrunk": shrunk,
        }
    return out
