"""The breakdown of each elastic event into its phases (spans in ``--json`` and the Perfetto trace), as vLLM 0.33.0
runs them: PREPARE, the drain of async EPLB, COMMIT, the reshuffle, the departing ranks' exit."""

from __future__ import annotations

import json

import pytest

from sim.run import run_scenario
from sim.scenario import load, with_overrides


def phases(result, kind: str) -> list[tuple[str, float, float]]:
    return [(w, a, b) for w, a, b in result.spans if w.startswith(kind + ".")]


@pytest.mark.parametrize(
    "scenario, overrides, kind, names",
    [
        ("scale-up", {}, "scale_up", ["prepare", "commit", "reshuffle"]),
        ("scale-up", {"eplb.use_async": True}, "scale_up", ["prepare", "drain", "commit", "reshuffle"]),
        ("scale-down", {}, "scale_down", ["prepare", "reshuffle", "commit", "exit"]),
        ("abort", {}, "abort", ["prepare", "abort", "exit"]),
    ],
)
def test_each_event_is_its_phases_back_to_back(scenario, overrides, kind, names) -> None:
    r = run_scenario(with_overrides(load(scenario), **overrides), strategy="per-communicator-agent")
    assert r.verdict in ("pass", "safety"), r.detail
    got = phases(r, kind)
    assert [w.split(".", 1)[1] for w, _, _ in got] == names
    (whole,) = [(a, b) for w, a, b in r.spans if w == kind]
    assert got[0][1] == whole[0] and got[-1][2] <= whole[1] + 1e-9
    assert all(prev[2] == nxt[1] for prev, nxt in zip(got, got[1:]))  # no gap between phases
    prepare = got[0]
    assert prepare[2] - prepare[1] >= load(scenario).timeline[0].prepare_s - 1e-9  # PREPARE serves its window
    assert "rebalance" not in [w for w, a, b in r.spans if whole[0] <= a and b <= whole[1]]  # (the reshuffle's own)


def test_the_phases_are_slices_of_the_perfetto_trace(tmp_path) -> None:
    r = run_scenario(load("scale-down"), strategy="shared-agent", out=tmp_path)
    slices = [
        e["name"]
        for e in json.loads((tmp_path / "trace.perfetto.json").read_text())["traceEvents"]
        if e.get("ph") == "X"
    ]
    assert [s for s in slices if s.startswith("scale_down")] == [w for w, _, _ in r.spans if w.startswith("scale_down")]


def test_a_calibrated_collection_is_what_the_commit_costs() -> None:
    """With ``collect_s`` measured (epsim calibrate), each planned collection holds its rank that long: vLLM 0.33.0's
    COMMIT collects twice (switch_and_prepare, warm_and_capture), the later revision once."""
    from sim.calibration import Calibration

    cal = Calibration(xfer_latency_s=1e-4, bandwidth_Bps=1e9, collect_s=0.2)
    for lifecycle, collections in (("0.33.0", 2), ("pr-53947", 1)):
        r = run_scenario(
            with_overrides(load("scale-up"), lifecycle=lifecycle), strategy="shared-agent", calibration=cal
        )
        (commit,) = [b - a for w, a, b in r.spans if w == "scale_up.commit"]
        assert commit == pytest.approx(collections * 0.2), lifecycle
    plain = run_scenario(load("scale-up"), strategy="shared-agent")
    assert [b - a for w, a, b in plain.spans if w == "scale_up.commit"] == [0.0]
