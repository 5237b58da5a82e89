"""The Ray engine (``epsim sweep --engine ray``): the same rows as the local engine, crashed and hung runs recorded,
and a run's timeout counted from the moment the run begins.  One local Ray instance serves the whole file: starting
one takes seconds of a small machine's CPU."""

from __future__ import annotations

import pytest

from sim.lab import executors
from sim.lab import sweep as sweep_mod

pytest.importorskip("ray", reason="the Ray engine needs the ray extra (pip install 'epsim[ray]')")

PCA = "per-communicator-agent"


@pytest.fixture(scope="module")
def ray_started():
    """Ray started once for the file (two CPUs); each test's engine joins it, as a sweep joins a running Ray."""
    first = executors.RayEngine(workers=2)
    first.start()
    yield
    first.ray.shutdown()


def test_a_run_s_timeout_does_not_count_a_fresh_worker_s_start_up(ray_started) -> None:
    """A fresh Ray worker starts and imports the simulator (torch: seconds) before its first run; runs of a few
    hundredths of a second under a 2 s timeout all pass.  (First in the file, so that its worker is a fresh one.)"""
    rows = list(executors.RayEngine(workers=1, timeout=2.0).map(sweep_mod.plan("steady", range(3))))
    assert [r["verdict"] for r in rows] == ["pass"] * 3, [r["detail"] for r in rows]


def test_ray_engine_gives_the_same_verdicts_and_trace_hashes_as_the_local_one(ray_started) -> None:
    specs = sweep_mod.plan("scale-up", range(4), ["shared-agent", PCA], ["rocm-strict"], swarm=True)
    local = {
        r["run_key"]: (r["verdict"], r["signature"], r["trace_hash"], r["faults_armed"])
        for r in executors.LocalEngine(2).map(specs)
    }
    remote = {
        r["run_key"]: (r["verdict"], r["signature"], r["trace_hash"], r["faults_armed"])
        for r in executors.RayEngine(workers=2).map(specs)
    }
    assert remote == local and len(local) == 8
    assert {v for v, *_ in local.values()} >= {"pass", "crash"}


def test_ray_engine_records_crashed_and_hung_runs(ray_started) -> None:
    specs = (
        sweep_mod.plan("steady", range(1), ["tests.strategies.misbehaving:crash_process"])
        + sweep_mod.plan("steady", range(1), ["tests.strategies.misbehaving:spin"])
        + sweep_mod.plan("steady", range(1), ["shared-agent"])
    )
    # The passing run takes a fraction of a second once begun; the clock starts then, not at submission (the next
    # test), so a loaded machine's worker start-up does not make it a timeout.
    rows = {r["run_key"]: r for r in executors.RayEngine(workers=2, timeout=6).map(specs)}
    assert [rows[s.key]["verdict"] for s in specs] == ["worker_crash", "timeout", "pass"]
