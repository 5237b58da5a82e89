"""Timing calibration: measured on the real backend, taken by the simulation, compared with real runs."""

from __future__ import annotations

import json
import os

import pytest

from sim import scenario as scenario_mod
from sim.calibration import Calibration, fit, load
from sim.errors import ScenarioError
from sim.run import run_scenario
from tests.conftest import epsim, epsim_here, real_nixl_or_skip


def test_fit_recovers_latency_and_bandwidth_by_relative_error():
    points = [(n, 20e-6 + n / 5e9) for n in (1 << 16, 1 << 20, 1 << 24, 1 << 26)]
    latency, bandwidth = fit(points)
    assert latency == pytest.approx(20e-6, rel=1e-6) and bandwidth == pytest.approx(5e9, rel=1e-6)
    # no visible fixed cost: the line through the origin, never a negative latency
    latency, bandwidth = fit([(1 << 20, 1e-4), (1 << 24, 1.7e-3)])
    assert latency >= 0 and bandwidth > 0
    with pytest.raises(ValueError):
        fit([(1, 1.0)])


def test_bad_calibration_files_are_one_line_errors(tmp_path):
    with pytest.raises(ScenarioError, match="no such file"):
        load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ScenarioError, match="not a JSON file"):
        load(tmp_path / "bad.json")
    (tmp_path / "neg.json").write_text(json.dumps({"xfer_latency_s": -1, "bandwidth_Bps": 1e9}))
    with pytest.raises(ScenarioError, match="xfer_latency_s"):
        load(tmp_path / "neg.json")
    (tmp_path / "deep.json").write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(ScenarioError, match="nested too deeply"):
        load(tmp_path / "deep.json")
    os.mkfifo(tmp_path / "fifo")  # read for ever, were it read
    with pytest.raises(ScenarioError, match="not a regular file"):
        load(tmp_path / "fifo")
    done = epsim_here("run", "steady", "--calibration", str(tmp_path / "missing.json"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "epsim calibrate" in done.stderr


def test_calibrate_out_refuses_a_file_that_is_not_a_calibration_before_measuring(tmp_path):
    real_nixl_or_skip()
    notes = tmp_path / "notes.txt"
    notes.write_text("precious notes\n")
    done = epsim_here("calibrate", "--quick", "--no-compare", "--out", str(notes))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (
        f"epsim: error: --out {notes}: that file exists and is not an epsim calibration; "
        f"give a new file name, or an earlier calibration to replace"
    )
    assert notes.read_text() == "precious notes\n"


def test_the_simulation_takes_the_calibrated_times():
    sc = scenario_mod.load("scale-up")
    slow = Calibration(xfer_latency_s=1e-3, bandwidth_Bps=1e9, collective_latency_s=1e-3)
    base = run_scenario(sc)
    calibrated = run_scenario(sc, calibration=slow)
    again = run_scenario(sc, calibration=slow)
    assert calibrated.trace_hash == again.trace_hash  # still deterministic
    assert calibrated.verdict == base.verdict == "pass"

    def rebalance_s(r):
        return sum(b - a for what, a, b in r.spans if what == "rebalance")

    # 1 ms per READ and per collective, 1 GB/s: rebalances take far longer than at the defaults (40 GB/s, 10 us)
    assert rebalance_s(calibrated) > 10 * rebalance_s(base) > 0
    assert [s[0] for s in calibrated.spans] == [s[0] for s in base.spans]


def test_calibrate_measures_writes_and_compares(tmp_path):
    real_nixl_or_skip()
    out = tmp_path / "cal.json"
    out.write_text(Calibration(xfer_latency_s=1.0, bandwidth_Bps=1.0).model_dump_json())  # an earlier one: replaced
    # --quick: every measurement, the fit and a comparison, with fewer sizes, repeats and cases (calibrate.FULL)
    done = epsim("calibrate", "--quick", "--out", str(out), "--json", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    cal = load(out)
    assert cal.process_start_s is not None
    assert cal.bandwidth_Bps > 1e8 and cal.collective_latency_s > 0 and cal.process_start_s > 0
    assert 0 < cal.collect_s < 10  # a planned gc.collect() in a process loaded as a rank is
    assert cal.concurrent_share is not None and cal.concurrent_share > 0  # recorded, not judged (timing)
    assert len(cal.points) == 3 and cal.memory == "DRAM" and cal.quick and cal.xfer_latency_s < 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.json"]  # written through a file beside it
    # the loaded-host rows: every cost measured with 2 and 3 processes at once, the stall fitted on one real run
    assert [r.ranks for r in cal.loaded] == [2, 3] and cal.fitted_on.startswith("scale-up 2->3")
    for row in cal.loaded:
        assert row.bandwidth_Bps > 1e7 and 0 < row.collective_s < 1 and 0 < row.collect_s < 10
        assert row.first_agent_s > 0 and row.first_remote_setup_s > 0 and row.teardown_s > 0 and row.stall_s >= 0
        assert len(row.rounds) == row.ranks * 3 * 2 * 2  # members x repeats x reads x row sizes
    assert cal.loaded[1].stall_s >= cal.loaded[0].stall_s  # proportional to the ranks
    cmp = report["comparison"]
    fitted, judged = cmp["runs"]
    assert fitted["fitted"] and not judged["fitted"] and judged["scenario"].startswith("scale-up 2->4")
    for run in cmp["runs"]:
        assert run["sim_verdict"] == run["real_verdict"] == "pass"
        assert {r["what"] for r in run["spans"]} == {
            "rebalance",
            "scale_up",
            "scale_up.prepare",
            "scale_up.commit",
            "scale_up.reshuffle",
        }
    # the numbers are this host's (docs/validation.md records them); that they are there and judged is the test
    assert set(cmp["summary"]) == {"rebalance", "scale_up", "scale_up.prepare", "scale_up.commit", "scale_up.reshuffle"}
    assert all(isinstance(row["within_25%"], bool) for row in cmp["summary"].values())
    # the file drives a simulated run
    done = epsim("run", "scale-up", "--calibration", str(out), "--json")
    assert done.returncode == 0, done.stderr


def test_a_comparison_whose_real_run_failed_says_it_is_incomplete(monkeypatch):
    """A real run that failed must not cut the span table short without a word."""
    import real_backends.calibrate as cal_mod
    import real_backends.run as run_mod
    import sim.run as sim_run

    class _R:
        def __init__(self, verdict, spans, detail=None):
            self.verdict, self.spans, self.detail = verdict, spans, detail

    spans = [["rebalance", 0.0, 1.0], ["scale_up", 1.0, 2.0], ["rebalance", 2.0, 3.0]]
    monkeypatch.setattr(sim_run, "run_scenario", lambda *a, **k: _R("pass", spans))
    monkeypatch.setattr(run_mod, "run_real", lambda *a, **k: _R("crash", spans[:1], "worker@1: boom"))
    # (the calibration's numbers are never read: run_scenario is replaced)
    run = cal_mod.compare_one(
        cal_mod.Calibration.model_construct(xfer_latency_s=0.0, bandwidth_Bps=1.0), cal_mod.FIT_CASE, "cpu"
    )
    assert not run["complete"] and (run["spans_simulated"], run["spans_measured"], len(run["spans"])) == (3, 1, 1)
    assert run["real_verdict"] == "crash" and run["real_detail"] == "worker@1: boom"


def test_spans_pair_by_kind_and_count_when_one_world_rebalanced_once_more(monkeypatch):
    """The worlds may serve a few steps more or less while a PREPARE builds: one more rebalance at the end of one
    of them must not shift every later pair."""
    import real_backends.calibrate as cal_mod
    import real_backends.run as run_mod
    import sim.run as sim_run

    class _R:
        def __init__(self, spans):
            self.verdict, self.spans, self.detail = "pass", spans, None

    sim = [["rebalance", 0, 1], ["scale_up.prepare", 1, 2], ["scale_up", 1, 2], ["rebalance", 2, 3]]
    real = [
        ["rebalance", 0, 2],
        ["scale_up.prepare", 2, 4],
        ["scale_up", 2, 4],
        ["rebalance", 4, 6],
        ["rebalance", 6, 8],
    ]
    monkeypatch.setattr(sim_run, "run_scenario", lambda *a, **k: _R(sim))
    monkeypatch.setattr(run_mod, "run_real", lambda *a, **k: _R(real))
    run = cal_mod.compare_one(
        cal_mod.Calibration.model_construct(xfer_latency_s=0.0, bandwidth_Bps=1.0), cal_mod.FIT_CASE, "cpu"
    )
    assert [(r["what"], r["error"]) for r in run["spans"]] == [
        ("rebalance", -0.5),
        ("scale_up.prepare", -0.5),
        ("scale_up", -0.5),
        ("rebalance", -0.5),
    ]
    assert not run["complete"]  # one real rebalance had no simulated partner


def test_the_concurrent_reads_measurement_runs_on_the_real_nixl():
    """benchmarks/concurrent_reads.py is the evidence for the simulated link model (docs/validation.md): it runs
    and reads the right bytes.  What it measures is recorded in docs/results/real/, not asserted here."""
    import subprocess
    import sys

    real_nixl_or_skip()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.concurrent_reads", "--k", "2", "--sizes-mib", "0.25", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["bytes_ok"] and out["memory"] == "DRAM" and list(out["sizes"]) == ["0.25MiB"]
    row = out["sizes"]["0.25MiB"]
    assert min(row["one_s"], row["together_s"], row["one_of_k_times_the_bytes_s"]) > 0


def test_real_spans_leave_out_the_harness_checks_and_add_up_an_events_phases():
    """A real rebalance and a reshuffle last as long as their slowest rank's move (not the parent's round trips and
    weight checks after it); an elastic event as long as its phases, which follow each other as in the simulation."""
    from types import SimpleNamespace

    from real_backends.run import _spans

    records = [
        (0.0, "engine.rebalance", {}),
        (0.01, "eplb.moved", {"seconds": 0.02}),
        (0.02, "eplb.moved", {"seconds": 0.03}),
        (1.0, "engine.scale_up", {}),
        (2.0, "engine.rebalance", {}),
        (2.05, "eplb.moved", {"seconds": 0.04}),
    ]
    spans = [
        ("rebalance", 0.0, 0.5),
        ("scale_up.prepare", 1.0, 1.6),
        ("scale_up.commit", 1.6, 2.0),
        ("scale_up.reshuffle", 2.0, 2.3),
        ("scale_up", 1.0, 2.3),
    ]
    got = _spans(spans, SimpleNamespace(records=records))
    assert got == [
        ["rebalance", 0.0, 0.03],
        ["scale_up.prepare", 1.0, 1.6],
        ["scale_up.commit", 1.6, 2.0],
        ["scale_up.reshuffle", 2.0, 2.04],
        ["scale_up", 1.0, 2.04],
    ]


def test_a_shipped_calibration_is_taken_by_name_and_a_wrong_name_lists_them(tmp_path, monkeypatch):
    from sim.calibration import bundled

    assert "cpu-2core-1ms-poll" in bundled()
    cal = load("cpu-2core-1ms-poll")
    assert [r.ranks for r in cal.loaded] == [2, 3, 4] and cal.fitted_on and not cal.quick
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cpu-2core-1ms-poll").write_text("{")  # a file of that name here is the file asked for
    with pytest.raises(ScenarioError, match="not a JSON file"):
        load("cpu-2core-1ms-poll")
    with pytest.raises(ScenarioError, match="name a shipped one: cpu-2core-1ms-poll"):
        load("no-such-host")
