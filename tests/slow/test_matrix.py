"""The strategy matrix (strategies x profiles x built-in scenarios x GC faults): its expectations, and that
docs/results.md is what the matrix gives today."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.lab.matrix import (
    GC_FAULTS,
    LATER,
    MATRIX_STRATEGIES,
    MODELLED_BY,
    PROFILES,
    SCENARIOS,
    STREAM_MODES,
    STREAM_SYNCED,
    lifecycle_differences,
    render,
    render_deep_ep,
    render_lifecycle,
    render_stream_lag,
    render_vllm,
    run_deep_ep,
    run_lifecycle,
    run_matrix,
    run_stream_lag,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "results.md"


@pytest.fixture(scope="module")
def cells():
    return run_matrix()


def cell(cells, scenario, strategy, profile, fault=""):
    return next(
        c.result for c in cells if (c.scenario, c.strategy, c.profile, c.fault) == (scenario, strategy, profile, fault)
    )


def test_matrix_is_complete(cells) -> None:
    assert len(cells) == len(SCENARIOS) * len(MATRIX_STRATEGIES) * len(PROFILES) * len(GC_FAULTS)


def test_async_eplb_gives_every_cell_the_same_verdict(cells) -> None:
    """vLLM's default is async EPLB (and elastic EP needs NIXL for it): the layers move on the async thread while the
    group serves, the reshuffle after a scale-up too, with the async loop's collectives.  None of that moves a
    verdict in these scenarios (checked on 2026-12-02, when the async loop became vLLM's)."""
    async_cells = run_matrix(eplb_async=True)
    assert [(c.scenario, c.strategy, c.profile, c.fault, c.short) for c in async_cells] == [
        (c.scenario, c.strategy, c.profile, c.fault, c.short) for c in cells
    ]
    assert any(c.result.trace_hash != s.result.trace_hash for c, s in zip(async_cells, cells))  # it ran async


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
    assert {(c.result.verdict, c.result.invariant) for c in cells if c.scenario == "rank-failure"} == {
        ("liveness", "stuck")
    }


@pytest.fixture(scope="module")
def deep_cells():
    return run_deep_ep()


def deep(cells, backend, nvshmem, column, lifecycle=LATER):
    """A DeepEP cell; by default under pr-53947, whose buffers are made on the first forward step on a group (the
    tests below read that order)."""
    return next(
        c.result
        for c in cells
        if (c.backend, c.nvshmem, c.lifecycle) == (backend, nvshmem, lifecycle) and c.column.startswith(column)
    )


def test_under_0_33_0_the_standby_buffer_meets_the_live_old_world_on_every_nvshmem_build(deep_cells) -> None:
    """vLLM 0.33.0 makes the new group's buffer at PREPARE, while the old group's serves: NVSHMEM is initialised
    again with a live world, which only bumps its count, so the new group's first call hangs, patch or not."""
    for nvshmem in ("stock", "elastic", "mi355"):
        for scenario in ("scale-up", "scale-down", "elastic-cycle"):
            r = deep(deep_cells, "deepep_low_latency", nvshmem, scenario, "0.33.0")
            assert (r.verdict, r.invariant) == ("liveness", "collective_timeout"), (nvshmem, scenario, r.detail)
            assert "elastic-prepare@" in r.detail and "a buffer of the old world is still alive" in r.detail
    for column in ("scale-up", "scale-down", "elastic-cycle", "scale-up, explicitly_destroy=False"):
        # high throughput never touches NVSHMEM: the order of the buffers changes none of its cells
        now, then = (deep(deep_cells, "deepep_high_throughput", "stock", column, lc) for lc in ("0.33.0", LATER))
        assert (now.verdict, now.invariant) == (then.verdict, then.invariant), column


def test_vllm_flow_fails_on_stock_nvshmem_and_on_the_elastic_patch_only_where_the_cleanup_races(deep_cells) -> None:
    # New low-latency buffers are made on the new group's first forward step; when the background cleanup destroyed
    # the old ones first, a finalized stock NVSHMEM reuses the old world (its size), the patched one starts a new one.
    for scenario in ("scale-up", "scale-down", "elastic-cycle"):
        stock = deep(deep_cells, "deepep_low_latency", "stock", scenario)
        assert (stock.verdict, stock.invariant) == ("liveness", "collective_timeout"), stock.detail
        assert "the old world was reused" in stock.detail
        mi355 = deep(deep_cells, "deepep_low_latency", "mi355", scenario)
        assert mi355.verdict == "crash" and "NvshmemError" in mi355.detail
    # The cleanup runs on a background thread while the new group serves (vLLM's _start_group_cleanup), so the two
    # race even with the patch; at the matrix's seed every cleanup wins (tests/sim/test_all2all.py counts the seeds
    # that lose it; the next test makes it lose at every seed).
    for scenario in ("scale-up", "scale-down", "elastic-cycle"):
        assert deep(deep_cells, "deepep_low_latency", "elastic", scenario).verdict == "pass"


def test_old_and_new_buffers_alive_together_fail_even_with_the_patch(deep_cells) -> None:
    late = deep(deep_cells, "deepep_low_latency", "elastic", "scale-up, cleanup 5 s late")
    assert (late.verdict, late.invariant) == ("liveness", "collective_timeout")
    assert "a buffer of the old world is still alive" in late.detail


def test_a_buffer_collected_on_one_rank_only_is_liveness_naming_that_rank(deep_cells) -> None:
    r = deep(deep_cells, "deepep_high_throughput", "stock", "scale-up, explicitly_destroy=False")
    assert (r.verdict, r.invariant) == ("liveness", "collective_timeout")
    assert "finalizer Buffer.__del__" in r.detail and "destroy" in r.detail and "(pids [1])" in r.detail


def test_intranode_high_throughput_never_touches_nvshmem_but_leaks_the_survivors_old_buffers(deep_cells) -> None:
    # The MoE layer held the only strong reference: the switch drops the old buffer, DeepEP warns, the cleanup finds
    # an empty weak cache.  No NVSHMEM world is involved, so a late cleanup changes nothing.
    for column in ("scale-up", "scale-up, cleanup 5 s late", "scale-up, rank 1's LL parity skewed"):
        r = deep(deep_cells, "deepep_high_throughput", "stock", column)
        assert (r.verdict, r.invariant) == ("safety", "leak"), (column, r.detail)
        assert "DeepEP buffer eplb#0/ep/deep_ep#0 was dropped without destroy()" in r.detail
    # With the buffers held and destroyed explicitly (LL keeps a class-level reference), nothing leaks.
    assert deep(deep_cells, "deepep_low_latency", "elastic", "scale-up").verdict == "pass"


def test_a_skewed_low_latency_parity_hangs_the_peers_waiting_for_that_rank(deep_cells) -> None:
    r = deep(deep_cells, "deepep_low_latency", "elastic", "scale-up, rank 1's LL parity skewed")
    assert (r.verdict, r.invariant) == ("liveness", "collective_timeout") and "(pids [1])" in r.detail


def test_a_handle_from_before_the_ep_size_changed_is_refused(deep_cells) -> None:
    # (High throughput leaks its old buffers at the switch first; tests/unit checks its handles.)
    r = deep(deep_cells, "deepep_low_latency", "elastic", "scale-up, rank 0 combines with a stale handle")
    assert r.verdict == "crash" and "handle from another buffer (EP size 2, this buffer 4)" in r.detail


@pytest.fixture(scope="module")
def stream_cells():
    return run_stream_lag()


@pytest.mark.parametrize("mode", [m for m, _, _ in STREAM_MODES])
def test_a_stream_behind_breaks_every_builtin_strategy_everywhere(stream_cells, mode) -> None:
    """vLLM's zero-copy data path orders nothing after the stream: with it 10 ms behind (an injected lag, or the
    forward work the host left queued), a later layer's expert ends up in a row in every scenario, whatever the
    agent lifecycle."""
    for c in stream_cells:
        if c.strategy in MATRIX_STRATEGIES and c.mode == mode:  # vLLM 0.33.0's own code included
            assert (c.result.verdict, c.result.invariant) == ("safety", "expert_weights"), (c.strategy, c.scenario)
            assert "of layer" in c.result.detail


@pytest.mark.parametrize("mode", [m for m, _, _ in STREAM_MODES])
def test_synchronizing_the_stream_leaves_only_shared_agents_own_findings(stream_cells, cells, mode) -> None:
    synced = [c for c in stream_cells if c.strategy == STREAM_SYNCED and c.mode == mode]
    for c in synced:
        plain = cell(cells, c.scenario, "shared-agent", "cuda")
        assert (c.result.verdict, c.result.invariant) == (plain.verdict, plain.invariant), c.scenario
    assert {c.result.verdict for c in synced} == {"pass", "safety", "liveness"}


@pytest.fixture(scope="module")
def later_cells():
    return run_lifecycle()


def test_the_lifecycle_revisions_differ_only_where_0_33_0_collects_after_the_swap(cells, later_cells) -> None:
    """Under pr-53947 the GC matrix differs from 0.33.0's only in the gc.cycle cells of the scenarios that commit a
    scale-down, for the strategies whose old communicator owns its agent; every difference is explained."""
    differ = lifecycle_differences(cells, later_cells)
    assert {(o.scenario, o.strategy, o.fault, o.short, t.short) for o, t in differ} == {
        (scenario, strategy, "gc.cycle", "pass", "safety: stale_peer")
        for scenario in ("scale-down", "elastic-cycle")
        for strategy in ("per-communicator-agent", "vllm")
    }
    assert "not explained yet" not in render_lifecycle(cells, later_cells)
    assert {c.scenario for c in later_cells} == set(SCENARIOS) - {"abort"}


def test_docs_results_is_current(cells, deep_cells, stream_cells, later_cells) -> None:
    expected = (
        render(cells)
        + "\n"
        + render_vllm(cells)
        + "\n"
        + render_lifecycle(cells, later_cells)
        + "\n"
        + render_deep_ep(deep_cells)
        + "\n"
        + render_stream_lag(stream_cells)
    )
    assert DOC.read_text() == expected, "docs/results.md is stale: python -m sim.lab.matrix > docs/results.md"


def test_vllm_0_33_0s_own_code_agrees_with_its_model_on_every_cell(cells) -> None:
    """per-communicator-agent is the model of vLLM 0.33.0's NixlEplbCommunicator: the released code, run unmodified,
    gets the same verdict in every cell."""
    ours = {(c.scenario, c.profile, c.fault): c.short for c in cells if c.strategy == "vllm"}
    model = {(c.scenario, c.profile, c.fault): c.short for c in cells if c.strategy == MODELLED_BY["vllm"]}
    assert ours == model


def test_the_seeds_change_on_vllms_code_differs_from_its_model_only_at_abort(cells) -> None:
    ours = {(c.scenario, c.profile, c.fault): c.short for c in cells if c.strategy == "vllm+shared-agent"}
    model = {(c.scenario, c.profile, c.fault): c.short for c in cells if c.strategy == "shared-agent"}
    differ = {k for k in ours if ours[k] != model[k]}
    assert {k[0] for k in differ} == {"abort"} and all(ours[k] == "safety: stale_peer" for k in differ)
