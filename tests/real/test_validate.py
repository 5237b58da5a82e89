"""``epsim validate``: simulation and real backend side by side, on this machine's host memory."""

from __future__ import annotations

import json

from real_backends.validate import CASES, Case, compare
from sim.run import Result
from tests.conftest import epsim, real_nixl_or_skip


def test_quick_validation_agrees_with_the_simulation_on_every_case():
    real_nixl_or_skip()
    done = epsim("validate", "--quick", "--no-catalogue", "--json", timeout=600)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    quick = [c.name for c in CASES if c.quick]
    assert [c["case"] for c in report["cases"]] == quick and len(quick) >= 4
    bad = [(c["case"], c["differences"]) for c in report["cases"] if not c["agree"]]
    assert not bad, bad
    assert done.returncode == 0, done.stderr[-2000:]
    verdicts = {c["case"]: c["real"]["verdict"] for c in report["cases"]}
    assert verdicts["rank-failure · shared-agent"] == "liveness"  # a killed rank, for real
    assert all(c["real"]["profile"] == "real-cpu" and c["sim"]["profile"] == "dram" for c in report["cases"])


def _result(verdict="pass", invariant=None, signature=None, **metrics) -> Result:
    return Result(verdict, invariant, None, 0, "s", "x", "dram", "h", 1, 0.0, 0.0, metrics=metrics,
                  signature=signature)


def test_compare_names_each_difference():
    assert compare(_result(transfers=3), _result(transfers=3)) == (True, [])
    agree, diffs = compare(_result(transfers=3), _result(transfers=4))
    assert not agree and diffs == ["transfers 3 vs 4"]
    agree, diffs = compare(_result("safety", "stale_peer"), _result())
    assert not agree and diffs[0] == "verdict safety/stale_peer vs pass/None"
    # two crashes agree only on the same exception; their ledgers are not compared (timing decides them)
    a = _result("crash", "exception", "exception:nixlNotFoundError|x|-", transfers=1)
    b = _result("crash", "exception", "exception:nixlNotAllowedError|x|-", transfers=9)
    assert compare(a, a.__class__(**{**a.to_dict(), "metrics": {"transfers": 9}}))[0]
    assert compare(a, b) == (False, ["crash exception:nixlNotFoundError|x|- vs exception:nixlNotAllowedError|x|-"])


def test_case_names_show_the_ep_sizes_and_faults():
    assert Case("scale-down", "shared-agent", {"ranks": 3, "timeline.0.to": 2}, ("gc.cycle",)).name == \
        "scale-down 3->2 · shared-agent · gc.cycle"
    assert len({c.name for c in CASES}) == len(CASES)


def test_cases_for_one_device_run_only_there(monkeypatch):
    """The stream-lag cases need a CUDA stream to lag: validate on host memory leaves them out (and says nothing
    about them), on VRAM it runs them like the others."""
    import real_backends.validate as validate

    lagged = [c for c in CASES if c.device == "cuda"]
    assert {c.strategy for c in lagged} == {"shared-agent", "per-communicator-agent"}
    assert all(c.faults == ("device.stream_lag:delay_s=0.01",) and not c.quick for c in lagged)
    ran = []
    monkeypatch.setattr(validate, "run_case", lambda case, device, timeout_s: ran.append(case) or {"agree": True})
    validate.run_validation("cpu", catalogue=False)
    assert ran and not [c for c in ran if c.device is not None]
    ran.clear()
    validate.run_validation("cuda", catalogue=False)
    assert [c for c in ran if c.device == "cuda"] == lagged
