"""The strategy matrix (strategies x profiles x built-in scenarios x GC faults): its expectations, and that
docs/results.md is what the matrix gives today."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.matrix import GC_FAULTS, PROFILES, SCENARIOS, STRATEGIES, render, run_matrix

DOC = Path(__file__).resolve().parents[2] / "docs" / "results.md"


@pytest.fixture(scope="module")
def cells():
    return run_matrix()


def cell(cells, scenario, strategy, profile, fault=""):
    return next(c.result for c in cells if (c.scenario, c.strategy, c.profile, c.fault) ==
                (scenario, strategy, profile, fault))


def test_matrix_is_complete(cells) -> None:
    assert len(cells) == len(SCENARIOS) * len(STRATEGIES) * len(PROFILES) * len(GC_FAULTS)


@pytest.mark.parametrize("scenario", ["scale-up", "scale-down", "elastic-cycle", "abort"])
def test_per_communicator_agent_duplicates_pages_on_every_prepare_and_fails_rocm_strict(cells, scenario) -> None:
    for fault in GC_FAULTS:
        dram = cell(cells, scenario, "per-communicator-agent", "dram", fault)
        assert dram.metrics["duplicate_registrations"] > 0 and dram.metrics["max_live_agents_per_process"] >= 2
        strict = cell(cells, scenario, "per-communicator-agent", "rocm-strict", fault)
        assert (strict.verdict, strict.invariant) == ("crash", "exception")
        assert "elastic-prepare@" in strict.detail and "nixlBackendError" in strict.detail


def test_shared_agent_never_duplicates_registrations(cells) -> None:
    for c in cells:
        if c.strategy == "shared-agent":
            assert c.result.metrics["duplicate_registrations"] == 0, (c.scenario, c.profile, c.fault)
            assert c.result.verdict != "crash", (c.scenario, c.profile, c.fault, c.result.detail)


def test_shared_and_arena_agents_keep_departed_peers_after_scale_down(cells) -> None:
    for strategy in ("shared-agent", "arena-registry"):
        for profile in PROFILES:
            r = cell(cells, "scale-down", strategy, profile)
            assert (r.verdict, r.invariant) == ("safety", "stale_peer")


def test_every_scenario_without_reconfiguration_or_failure_passes(cells) -> None:
    for c in cells:
        if c.scenario == "steady":
            assert c.result.verdict == "pass", (c.strategy, c.profile, c.fault, c.result.detail)


def test_rank_failure_is_liveness_everywhere(cells) -> None:
    assert {(c.result.verdict, c.result.invariant) for c in cells if c.scenario == "rank-failure"} == \
        {("liveness", "stuck")}


def test_docs_results_is_current(cells) -> None:
    assert DOC.read_text() == render(cells), "docs/results.md is stale: python -m sim.matrix > docs/results.md"
