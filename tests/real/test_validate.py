"""``epsim validate``: simulation and real backend side by side, on this machine's host memory."""

from __future__ import annotations

import json
from typing import Any

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
    # Each case's outcome is on stderr as soon as it is known (so an interrupted validation keeps every finished
    # case): a line per case naming it, then one with both verdicts.
    lines = done.stderr.splitlines()
    assert sum(line.startswith("    agrees: simulated ") for line in lines) == len(quick)
    assert "    agrees: simulated liveness/stuck, real liveness/stuck" in lines
    assert all(c["real"]["profile"] == "real-cpu" and c["sim"]["profile"] == "dram" for c in report["cases"])
    # gc.late on either side of the departing rank's exit: the verdict turns on how long the exit takes
    timed = {
        c["case"]: (c["sim"]["verdict"], c["real"]["verdict"]) for c in report["cases"] if "calibrated" in c["case"]
    }
    assert timed == {
        "scale-down 3->2 · per-communicator-agent · gc.late:delay_s=0.05 · calibrated": ("pass", "pass"),
        "scale-down 3->2 · per-communicator-agent · gc.late:delay_s=5 · calibrated": ("safety", "safety"),
    }


def test_only_a_calibrated_clock_puts_a_late_collection_before_a_ranks_exit():
    """The simulation's default clock gives an exit no duration, so a collection 50 ms late still finds the
    reconfiguration complete; with the calibration's collection and teardown it comes first, as on real ranks."""
    from real_backends.validate import REFERENCE_CALIBRATION
    from sim.calibration import load
    from sim.run import run_scenario

    [early, late] = [c for c in CASES if c.timed]
    cal = load(REFERENCE_CALIBRATION)

    def verdict(case, calibration):
        return run_scenario(
            case.load(), strategy=case.strategy, faults=list(case.faults), calibration=calibration
        ).verdict

    assert (verdict(early, None), verdict(early, cal)) == ("safety", "pass")
    assert (verdict(late, None), verdict(late, cal)) == ("safety", "safety")


def _result(verdict="pass", invariant=None, signature=None, **metrics) -> Result:
    return Result(verdict, invariant, None, 0, "s", "x", "dram", "h", 1, 0.0, 0.0, metrics=metrics, signature=signature)


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
    assert (
        Case("scale-down", "shared-agent", {"ranks": 3, "timeline.0.to": 2}, ("gc.cycle",)).name
        == "scale-down 3->2 · shared-agent · gc.cycle"
    )
    assert len({c.name for c in CASES}) == len(CASES)


def test_cases_for_one_device_run_only_there(monkeypatch):
    """The stream cases need a CUDA stream: validate on host memory leaves them out (and says nothing about them),
    on VRAM it runs them like the others, the lagged ones with the host in step, the others under vLLM's defaults;
    the host is in step with the GPU for every other case on VRAM (the agent lifecycle decides those)."""
    import real_backends.validate as validate

    cuda_only = [c for c in CASES if c.device == "cuda" and not c.deep_ep]
    lagged = [c for c in cuda_only if c.faults]
    assert {c.strategy for c in lagged} == {"shared-agent", "per-communicator-agent"}
    assert all(c.faults == ("device.stream_lag:delay_s=0.01",) and not c.quick and c.in_step for c in lagged)
    defaults = [c for c in cuda_only if not c.faults]
    assert {c.strategy for c in defaults} == {"shared-agent", "tests.strategies.stream_synced:create"}
    assert all(not c.in_step and c.load("cuda").serving.host_ahead_steps == 1.0 for c in defaults)
    assert all(c.load("cuda").serving.host_ahead_steps == 0.0 for c in CASES if c.in_step)
    assert all(c.load("cpu").serving.async_scheduling for c in CASES)  # (no stream to be ahead of on host memory)
    ran: list[Case] = []

    def run_case(case: Case, device: str, timeout_s: float, calibration=None) -> dict[str, Any]:
        ran.append(case)
        return {"agree": True}

    monkeypatch.setattr(validate, "run_case", run_case)
    validate.run_validation("cpu", catalogue=False)
    assert ran and not [c for c in ran if c.device is not None]
    ran.clear()
    report = validate.run_validation("cuda", catalogue=False)
    assert [c for c in ran if c.device == "cuda"] == cuda_only
    # The DeepEP cases need a build as well: without one (here) each is listed as skipped, with the reason.
    deep_ep = [c.name for c in CASES if c.deep_ep]
    assert deep_ep and [row["case"] for row in report["skipped"]] == deep_ep
    assert all("DeepEP" in row["reason"] or "GPU" in row["reason"] for row in report["skipped"])


def test_the_deep_ep_cases_are_what_one_gpu_holds():
    """Intranode high throughput takes 2, 4 or 8 ranks; every DeepEP case stays on those sizes, in step on VRAM."""
    for case in (c for c in CASES if c.deep_ep):
        sc = case.load("cuda")
        assert case.device == "cuda" and sc.all2all.backend == "deepep_high_throughput"
        assert set(sc.ep_sizes()) <= {2, 4, 8} and not sc.serving.async_scheduling


def test_a_weights_race_without_injected_lag_is_checked_against_the_lagged_simulation(capsys):
    """On a GPU the streams can fall behind by themselves (docs/validation.md: 6 of 48 unlagged cases on one shared
    H200).  Such a case still disagrees, and its row says whether the simulation with the streams lagged gives the
    real outcome."""
    from real_backends.validate import STREAM_LAG, with_stream_lag
    from sim.cli import _validation_table

    case = next(c for c in CASES if c.name == "scale-down 3->2 · per-communicator-agent · gc.never")
    sim = _result("safety", "stale_peer")
    broken = _result("safety", "expert_weights")
    assert with_stream_lag(case, "cpu", sim, broken) is None  # host copies are synchronous: no race to look for
    assert with_stream_lag(case, "cuda", sim, _result("liveness", "stuck")) is None
    assert with_stream_lag(case, "cuda", broken, broken) is None
    lagged_case = next(c for c in CASES if c.faults == (STREAM_LAG,))
    assert with_stream_lag(lagged_case, "cuda", sim, broken) is None  # lagged already: no second opinion to ask

    lagged = with_stream_lag(case, "cuda", sim, broken)
    assert lagged is not None
    assert lagged["fault"] == STREAM_LAG and lagged["matches_real"]
    assert lagged["sim"]["invariant"] == "expert_weights" and lagged["sim"]["profile"] == "cuda"

    rows = [
        {
            "case": case.name,
            "agree": False,
            "differences": ["verdict safety/stale_peer vs safety/expert_weights"],
            "sim": {"verdict": "safety", "invariant": "stale_peer", "signature": None},
            "real": {"verdict": "safety", "invariant": "expert_weights", "signature": None},
            "with_stream_lag": lagged,
        },
        {
            "case": "steady · shared-agent",
            "agree": True,
            "differences": [],
            "sim": {"verdict": "pass"},
            "real": {"verdict": "pass"},
        },
    ]
    _validation_table({"profile": "cuda", "device": "cuda", "cases": rows, "wall_s": 1.0})
    out = " ".join(capsys.readouterr().out.split())
    assert "the copy/READ race" in out
    assert "1 of 2 scenario cases agree; the copy/READ race without injected lag explains 1 more" in out


def test_a_stuck_command_is_judged_where_it_happened_not_after_the_teardown():
    """The parent's stuck details are judged where they happened, not after the whole history, so a crash during
    the teardown that follows (a survivor's collective failing once the stuck rank is killed) is not the verdict."""
    from real_backends.judge import judge

    events: list[tuple[float, int, int, str, dict[str, Any]]] = [
        (1.0, -1, 0, "engine.stuck", {"what": "serving", "pids": [1]}),
        (
            2.0,
            0,
            1,
            "thread.crash",
            {"thread": "worker@0", "pid": 0, "type": "RuntimeError", "error": "boom during teardown"},
        ),
    ]
    _, oracles = judge(events, 0.0, completed=False, stuck=["serving: no answer within 1 s; waiting for pids [1]"])
    assert oracles.verdict() == ("liveness", "stuck", "serving: no answer within 1 s; waiting for pids [1]")


def test_only_torch_distributed_errors_read_as_a_collective_failure():
    from real_backends.judge import judge

    def verdict(kind: str, error: str):
        events = [(1.0, 0, 0, "thread.crash", {"thread": "worker@0", "pid": 0, "type": kind, "error": error})]
        return judge(events, 0.0, completed=False, stuck=[])[1].verdict()[:2]

    assert verdict("DistBackendError", "Connection closed by peer [10.0.0.2]:1234") == (
        "liveness",
        "collective_timeout",
    )
    assert verdict("RuntimeError", "Operation timed out!") == ("liveness", "collective_timeout")  # Work.wait's
    assert verdict("ValueError", "my strategy does not support Gloo groups") == ("crash", "exception")
