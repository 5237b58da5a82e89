"""Whole simulated runs: literal histories, the expectations of the strategy matrix, determinism, faults."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from sim.run import run_scenario
from sim.scenario import load, with_overrides

STRATEGIES = ["per-communicator-agent", "arena-registry", "shared-agent"]
BROKEN = "tests.strategies.broken_shared_agent:create"

SYNCED = "tests.strategies.stream_synced:create"  # synchronizes the stream before its READs


def run(name: str, **kw):
    return run_scenario(load(name), **kw)


def test_scale_up_lifecycle_history_is_literal() -> None:
    sc = load("scale-up")
    r = run_scenario(sc, strategy="shared-agent", out=None)
    # the engine's steps of the lifecycle, in simulated time
    from sim.cluster import Cluster

    c = Cluster(sc, seed=0, strategy="shared-agent", profile="dram")
    c.run()
    engine = [
        (round(t, 2), kind.removeprefix("engine."), f.get("step"))
        for t, kind, f in c.kernel.history.records
        if kind in ("engine.rebalance", "engine.scale_up", "engine.shutdown")
    ]
    # Each rebalance that moves experts between ranks adds the time its 42 MiB READs take (1.1 ms each; a rank's
    # READs share its link, so its READs of one layer take one after another), and the clock drifts from the step
    # count.  The interval restarts at the reshuffle (step 1020, after 20 steps of PREPARE), as vLLM resets
    # expert_rearrangement_step after it.
    assert engine == [
        (6.25, "rebalance", 125),
        (31.26, "rebalance", 625),
        (50.02, "scale_up", 1000),
        (51.02, "rebalance", 1020),
        (76.04, "rebalance", 1520),
        (101.05, "rebalance", 2020),
        (126.06, "rebalance", 2520),
        (150.07, "rebalance", 3000),
        (150.09, "shutdown", 3000),
    ]
    swaps = [(round(t, 2), f["pid"]) for t, kind, f in c.kernel.history.records if kind == "comm.swap"]
    assert sorted(p for _, p in swaps) == [0, 1] and all(t == 51.02 for t, _ in swaps)
    assert r.verdict == "pass" and r.trace_hash == c.kernel.history.trace_hash()
    c.kernel.close()


@pytest.mark.parametrize("name", ["scale-up", "scale-down"])
def test_prepare_serves_exactly_prepare_s_whatever_the_seed(name: str) -> None:
    """A simulated PREPARE takes exactly prepare_s (1 s: 20 steps of 50 ms) and ends at the same instant as the
    serving that covers it; float rounding and the tie-break decided which came first, so some seeds served ten
    steps more than a real run does (found when READ times changed: the real backend's ledger then differed)."""
    from sim.cluster import Cluster

    for seed in range(6):
        c = Cluster(load(name), seed=seed, strategy="shared-agent", profile="dram")
        c.run()
        steps = [
            f["step"] for _, kind, f in c.kernel.history.records if kind in ("engine.scale_up", "engine.scale_down")
        ]
        after = [
            f["step"] for _, kind, f in c.kernel.history.records if kind == "engine.rebalance" and f["step"] > steps[0]
        ]
        c.kernel.close()
        assert after[0] == steps[0] + 20, (seed, steps, after)


def test_history_records_the_placement_each_rebalance_chose(monkeypatch) -> None:
    """The trace hash covers the policy's output, also where it moves no bytes between ranks (a reorder within a
    rank leaves every READ as it was)."""
    from sim.cluster import Cluster
    from sim.eplb import policy

    chosen, real = [], policy.rebalance

    def spy(*args, **kwargs):
        new = real(*args, **kwargs)
        chosen.append(new.digest())
        return new

    monkeypatch.setattr(policy, "rebalance", spy)
    c = Cluster(load("scale-up"), seed=0, strategy="shared-agent", profile="dram")
    c.run()
    recorded = [f["placement"] for _, kind, f in c.kernel.history.records if kind == "engine.rebalance"]
    assert recorded == chosen and len(set(recorded)) >= 2  # at least one per EP size
    c.kernel.close()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_same_seed_same_trace_hash_in_process(strategy: str) -> None:
    a, b = run("elastic-cycle", strategy=strategy, seed=3), run("elastic-cycle", strategy=strategy, seed=3)
    assert (a.trace_hash, a.events, a.verdict) == (b.trace_hash, b.events, b.verdict)
    assert run("elastic-cycle", strategy=strategy, seed=4).trace_hash != a.trace_hash


@pytest.mark.parametrize("hashseed", ["0", "4242"])
def test_same_seed_same_trace_hash_across_processes(hashseed: str, monkeypatch) -> None:
    here = run("abort", strategy="per-communicator-agent", seed=5, faults=["gc.late:delay_s=3"])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sim.cli",
            "run",
            "abort",
            "--seed",
            "5",
            "--strategy",
            "per-communicator-agent",
            "--fault",
            "gc.late:delay_s=3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONHASHSEED": hashseed},
    )
    assert json.loads(done.stdout)["trace_hash"] == here.trace_hash


def test_per_communicator_agent_registers_the_same_pages_twice_during_every_prepare() -> None:
    for name, prepares in (("scale-up", 1), ("elastic-cycle", 3), ("abort", 2)):
        r = run(name, strategy="per-communicator-agent")
        sizes = load(name).ep_sizes()
        survivors = sum(min(a, b) for a, b in zip(sizes, sizes[1:])) if name != "abort" else 2 * 2
        # vLLM 0.33.0 loads every peer when it builds a communicator: an aborted prepare's communicator still
        # holds the rank that was to join (as vLLM's own code does, tests/sim/test_vllm_strategy.py).
        assert (r.verdict, r.invariant) == (("safety", "stale_peer") if name == "abort" else ("pass", None)), r.detail
        assert r.metrics["max_live_agents_per_process"] == 2
        assert r.metrics["duplicate_registrations"] == survivors, (name, prepares)


@pytest.mark.parametrize("strategy", ["arena-registry", "shared-agent"])
@pytest.mark.parametrize("name", ["scale-up", "scale-down", "elastic-cycle", "abort"])
def test_shared_agents_never_duplicate_registrations(strategy: str, name: str) -> None:
    r = run(name, strategy=strategy)
    assert r.metrics["duplicate_registrations"] == 0
    assert r.metrics["max_live_agents_per_process"] == 1


def test_rocm_strict_fails_per_communicator_agent_at_prepare_only() -> None:
    r = run("scale-up", strategy="per-communicator-agent", profile="rocm-strict")
    assert (r.verdict, r.invariant) == ("crash", "exception")
    assert r.detail.startswith("elastic-prepare@") and "nixlBackendError" in r.detail
    for strategy in ("arena-registry", "shared-agent"):
        assert run("scale-up", strategy=strategy, profile="rocm-strict").verdict == "pass"


@pytest.mark.parametrize("strategy", ["arena-registry", "shared-agent"])
def test_departed_peers_stay_loaded_after_scale_down(strategy: str) -> None:
    r = run("scale-down", strategy=strategy)
    assert (r.verdict, r.invariant) == ("safety", "stale_peer")
    assert "departed pid 2" in r.detail
    assert run("scale-down", strategy="per-communicator-agent").verdict == "pass"


def test_rank_failure_is_a_liveness_failure_naming_the_dead_rank() -> None:
    r = run("rank-failure", strategy="shared-agent")
    assert (r.verdict, r.invariant) == ("liveness", "stuck")
    assert "pid 3: worker@3 killed" in r.detail


def test_broken_shared_agent_is_caught_by_scale_up() -> None:
    r = run("scale-up", strategy=BROKEN)
    assert r.verdict == "crash" and "nixlNotFoundError" in r.detail
    assert run("steady", strategy=BROKEN).verdict == "pass"  # no reconfiguration, nothing dropped


@pytest.mark.parametrize(
    "name, fault",
    [
        ("abort", "gc.cycle"),
        ("scale-up", "gc.thread"),
        ("elastic-cycle", "gc.late:delay_s=0.5"),
        ("abort", "gc.late:delay_s=0.5"),
    ],
)
def test_broken_shared_agent_is_caught_under_gc_faults(name: str, fault: str) -> None:
    """However late or wherever the broken finalizer runs, a later move finds the shared registrations gone."""
    r = run(name, strategy=BROKEN, faults=[fault])
    assert r.verdict == "crash" and "nixlNotFoundError" in r.detail, (r.verdict, r.detail)
    assert sum(r.faults_fired.values()) >= 1


@pytest.mark.parametrize(
    "fault, lifecycle, caught",
    [
        ("gc.late:delay_s=0.5", "0.33.0", ("crash", "exception")),
        ("gc.cycle", "0.33.0", ("crash", "exception")),
        ("gc.cycle", "pr-53947", ("safety", "released_twice")),
        ("gc.never", "0.33.0", ("safety", "released_twice")),
    ],
)
def test_late_gc_no_longer_hides_the_broken_finalizer(fault: str, lifecycle: str, caught: tuple[str, str]) -> None:
    """scale-up has no load drift.  A finalizer that runs half a second late breaks a later READ (the rebalance
    after the reshuffle still moves experts, as vLLM's policy reshuffles on sampling noise), and so does one that
    0.33.0's collection after the swap runs (before the reshuffle); when it runs at the process's exit (pr-53947's
    one collection before the swap leaves the cycle there) or never, no READ breaks and the ledger sees it: the new
    communicator's own cleanup deregisters the shared registrations the broken finalizer released."""
    from sim.scenario import with_overrides

    r = run_scenario(with_overrides(load("scale-up"), lifecycle=lifecycle), strategy=BROKEN, faults=[fault])
    assert (r.verdict, r.invariant) == caught, r.detail
    if caught[0] == "crash":
        assert r.detail is not None and "nixlNotFoundError" in r.detail


def test_gc_faults_change_where_the_old_communicator_dies() -> None:
    from sim.cluster import Cluster
    from sim.faults import parse

    def finals(fault):
        c = Cluster(
            load("scale-up"),
            seed=0,
            strategy="per-communicator-agent",
            profile="dram",
            faults=[parse(fault)] if fault else [],
        )
        c.run()
        drops = [(round(t, 3), f["how"]) for t, kind, f in c.kernel.history.records if kind == "gc.drop"]
        destroys = [round(t, 3) for t, kind, f in c.kernel.history.records if kind == "nixl.agent.destroy"]
        c.kernel.close()
        return drops, destroys

    plain_drops, plain = finals(None)
    late_drops, late = finals("gc.late:delay_s=2.5")
    assert [h for _, h in plain_drops][:2] == ["refcount", "refcount"]
    assert [h for _, h in late_drops][:2] == ["gc.late", "gc.late"]
    assert plain[:2] == [51.021, 51.021] and late[:2] == [53.521, 53.521]


@pytest.mark.parametrize("lifecycle", ["0.33.0", "pr-53947"])
def test_a_communicator_in_a_cycle_dies_at_its_processs_next_planned_collection(lifecycle) -> None:
    """COMMIT collects before the swap in both revisions; vLLM 0.33.0 collects again after it (warm_and_capture
    releases the CUDA graphs once more), so an old communicator that a cycle keeps dies inside the commit there,
    and at the process's exit in pr-53947."""
    from sim.cluster import Cluster
    from sim.faults import parse
    from sim.scenario import with_overrides

    c = Cluster(
        with_overrides(load("scale-up"), lifecycle=lifecycle),
        seed=0,
        strategy="per-communicator-agent",
        profile="dram",
        faults=[parse("gc.cycle:times=1")],
    )
    c.run()
    kinds = [
        (kind, f.get("how"), f.get("reason"), f.get("pid"))
        for _, kind, f in c.kernel.history.records
        if kind in ("gc.drop", "gc.collect", "nixl.agent.destroy", "comm.swap")
    ]
    c.kernel.close()
    # The first rank to commit (the tie-break's choice: pid 1) has its old communicator put in a cycle; the other's
    # is dropped by refcount and dies at once.
    if lifecycle == "0.33.0":
        assert kinds[:10] == [
            ("gc.collect", None, "commit@1", 1),
            ("comm.swap", None, None, 1),
            ("gc.drop", "gc.cycle", None, 1),
            ("gc.collect", None, "warm_and_capture@1", 1),
            ("nixl.agent.destroy", None, None, 1),
            ("gc.collect", None, "commit@0", 0),
            ("comm.swap", None, None, 0),
            ("gc.drop", "refcount", None, 0),
            ("nixl.agent.destroy", None, None, 0),
            ("gc.collect", None, "warm_and_capture@0", 0),
        ]
    else:  # it waits for pid 1's own next planned collection, its exit at shutdown, not the other rank's commit
        assert kinds[:7] == [
            ("gc.collect", None, "commit@1", 1),
            ("comm.swap", None, None, 1),
            ("gc.drop", "gc.cycle", None, 1),
            ("gc.collect", None, "commit@0", 0),
            ("comm.swap", None, None, 0),
            ("gc.drop", "refcount", None, 0),
            ("nixl.agent.destroy", None, None, 0),
        ]
        assert not [k for k in kinds if k[2] and k[2].startswith("warm_and_capture")]
        exit_1 = kinds.index(("gc.collect", None, "exit@1", 1))
        assert kinds[exit_1 + 1] == ("nixl.agent.destroy", None, None, 1)  # pid 1's old agent, broken free at last


@pytest.mark.parametrize("scenario", ["scale-down", "elastic-cycle"])
def test_the_collection_after_the_swap_decides_the_gc_cycle_cells(scenario) -> None:
    """The departed peers a cycle-kept communicator holds are removed before the reconfiguration completes under
    0.33.0; under pr-53947 they are still loaded then."""
    from sim.scenario import with_overrides

    runs = {
        lc: run_scenario(
            with_overrides(load(scenario), lifecycle=lc), strategy="per-communicator-agent", faults=["gc.cycle"]
        )
        for lc in ("0.33.0", "pr-53947")
    }
    assert runs["0.33.0"].verdict == "pass", runs["0.33.0"].detail
    assert (runs["pr-53947"].verdict, runs["pr-53947"].invariant) == ("safety", "stale_peer")


def test_bad_scenario_file_is_one_line_exit_2(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((load("scale-down").to_yaml()).replace("to: 2", "to: 7"))
    done = subprocess.run(
        [sys.executable, "-m", "sim.cli", "run", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "timeline[0].to" in lines[0], done.stderr


def test_run_writes_history_and_perfetto_trace(tmp_path) -> None:
    r = run("steady", strategy="shared-agent", out=tmp_path)
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    assert len(lines) == r.events and json.loads(lines[0])["kind"] == "thread.start"
    trace = json.loads((tmp_path / "trace.perfetto.json").read_text())["traceEvents"]
    instants = [e for e in trace if e["ph"] == "i"]
    assert len(instants) == r.events and all(e["pid"] >= 1 for e in trace)  # Perfetto treats pid 0 specially
    names = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert names == {1: "engine", 2: "pid 0", 3: "pid 1"}
    assert {e["pid"] for e in instants if e["name"].startswith("engine.")} == {1}
    slices = [(e["name"], e["pid"]) for e in trace if e["ph"] == "X"]
    assert slices == [("rebalance", 1)] * len(r.spans) and len(r.spans) >= 6
    assert all(e["dur"] >= 0 for e in trace if e["ph"] == "X")


def test_overrides_keep_runs_small() -> None:
    sc = with_overrides(load("steady"), steps=400)
    assert run_scenario(sc, strategy="shared-agent").verdict == "pass"


@pytest.mark.parametrize(
    "strategy, profile, verdict, where",
    [
        ("per-communicator-agent", "dram", "pass", None),
        ("arena-registry", "dram", "pass", None),
        ("shared-agent", "dram", "crash", "worker@"),  # reuses the agent, never registers the new buffer
        ("shared-agent", "rocm-strict", "crash", "worker@"),
        ("arena-registry", "rocm-strict", "crash", "elastic-prepare@"),  # coverage fails: a second agent registers
    ],
)
def test_storage_moved_before_prepare(strategy: str, profile: str, verdict: str, where: str | None) -> None:
    r = run("scale-up", strategy=strategy, profile=profile, faults=["storage.move"])
    assert r.verdict == verdict, r.detail
    if where:
        assert r.detail.startswith(where), r.detail
        assert ("nixlNotFoundError" if where == "worker@" else "nixlBackendError") in r.detail
    assert r.faults_fired["storage.move"] >= 1


@pytest.mark.parametrize(
    "strategy, verdict, error",
    [
        # Re-adding every peer every time is not idempotent once a peer recreated its agent under the same name: the
        # kept entry has the old connection and NIXL refuses the new one (vLLM fault 6 of docs/reference/vllm-eplb.md).
        ("shared-agent", "crash", "nixlNotAllowedError"),
        # The arena's peer cache keeps the dead connection: the first READ towards the restarted rank fails.
        ("arena-registry", "crash", "nixlRemoteDisconnectError"),
        # Fresh agents under fresh names for every communicator: nobody loads the restarted name again.
        ("per-communicator-agent", "pass", None),
    ],
)
def test_peer_restarted_under_the_same_name(strategy: str, verdict: str, error: str | None) -> None:
    r = run("scale-up", strategy=strategy, faults=["peer.restart:rank=1,times=1"])
    assert r.verdict == verdict, r.detail
    if error:
        assert r.detail.startswith("worker@0 (pid 0)") and error in r.detail, r.detail
    assert r.faults_fired["peer.restart:rank=1,times=1"] == 1


def test_a_run_leaves_no_module_instances_behind() -> None:
    """Each simulated process loads its own instance of the strategy's module; a sweep runs thousands of runs in one
    interpreter, so a finished run takes its instances out of sys.modules."""
    before = {m for m in sys.modules if "#epsim" in m}
    run("elastic-cycle", strategy="arena-registry")
    assert {m for m in sys.modules if "#epsim" in m} == before


def test_progress_reports_do_not_touch_the_run() -> None:
    seen = []
    with_progress = run_scenario(load("elastic-cycle"), on_progress=lambda step, sim_s: seen.append((step, sim_s)))
    assert run("elastic-cycle").trace_hash == with_progress.trace_hash
    assert seen and seen == sorted(seen) and seen[0] == (0, 0.0) and seen[-1][0] < load("elastic-cycle").steps


def test_a_nixl_fault_is_armed_at_its_step_inside_a_serving_chunk() -> None:
    from sim.cluster import Cluster
    from sim.faults import parse

    c = Cluster(
        load("steady"),
        seed=0,
        strategy="shared-agent",
        profile="dram",
        faults=[parse("nixl.xfer.late:at_step=137,delay=0.5")],
    )
    c.run()
    records = list(c.kernel.history.records)
    c.kernel.close()
    arm = next(i for i, (_, kind, f) in enumerate(records) if kind == "fault.arm")
    serving = [f["step"] for _, kind, f in records[:arm] if kind == "engine.serve"]
    assert serving[-1] < 137 and any(kind == "engine.serve" and f["step"] == 137 for _, kind, f in records[arm:])


def test_run_and_sweep_lines_keep_their_counts_whole_on_an_80_column_terminal() -> None:
    from rich.console import Console
    from rich.progress import Progress

    from sim.progress import run_columns, sweep_columns

    console = Console(width=80, force_terminal=True, record=True, color_system=None)
    progress = Progress(*run_columns(72000), console=console, auto_refresh=False)
    task = progress.add_task("deepseek-v3-ep64", total=72000, sim="499 s simulated · 70x")
    progress.update(task, completed=9750)
    console.print(progress.make_tasks_table(progress.tasks))
    line = console.export_text().strip()
    assert "deepseek-v3-ep64" in line and " 9750/72000 steps" in line, line

    console = Console(width=80, force_terminal=True, record=True, color_system=None)
    progress = Progress(*sweep_columns(2000), console=console, auto_refresh=False)
    task = progress.add_task("sweep", total=2000, failures=371, rate="10.6/s")
    progress.update(task, completed=1200)
    console.print(progress.make_tasks_table(progress.tasks))
    line = console.export_text().strip()
    assert " 1200/2000 runs · 371 failed · 10.6/s 0:00:00 · -:--:-- left" in line and "…" not in line, line


def test_garbage_from_before_a_run_is_neither_scanned_nor_finalized_inside_it() -> None:
    """A run freezes what existed before it: its planned collections cost what the run itself holds (not the
    caller's heap), and an earlier run's leftovers are not finalized in the middle of this one."""
    import gc

    finalized: list[str] = []

    class Leftover:
        def __del__(self) -> None:
            finalized.append("leftover")

    cycle: list[object] = [Leftover()]
    cycle.append(cycle)
    del cycle  # garbage now; only a collection can finalize it
    first = run_scenario(load("scale-up"))  # its planned collections used to finalize the leftover
    assert finalized == [] and gc.get_freeze_count() == 0  # and nothing stays frozen after the run
    gc.collect()
    assert finalized == ["leftover"]
    assert run_scenario(load("scale-up")).trace_hash == first.trace_hash


def test_a_caller_that_froze_objects_itself_keeps_them_frozen() -> None:
    import gc

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        run_scenario(load("steady"))
        # unfreezing is all or nothing, so the run must not do it (a few frozen objects die meanwhile: refcounts)
        assert gc.get_freeze_count() > 0.9 * frozen
    finally:
        gc.unfreeze()


def _async_run(scenario: str, faults=(), strategy: str | None = None, use_async: bool = True, **overrides):
    from sim.cluster import Cluster
    from sim.faults import parse

    sc = with_overrides(load(scenario), **{"eplb.use_async": use_async}, **overrides)
    cluster = Cluster(
        sc, seed=0, strategy=strategy or sc.strategy, profile=sc.profile, faults=[parse(f) for f in faults]
    )
    cluster.run()
    return cluster


def test_async_eplb_moves_layers_while_the_group_serves_and_drains_before_a_commit() -> None:
    """vLLM's EplbState.step moves one layer per forward step while serving goes on, also for the reshuffle after a
    scale-up (the newest vLLM resumes serving once it is scheduled); the last rebalance waits for every rank's
    layers."""
    cluster = _async_run("scale-up")
    assert cluster.oracles.verdict()[0] == "pass"
    records = [(kind, f) for _, kind, f in cluster.kernel.history.records]
    overlapped = drained = 0
    for i, (kind, _) in enumerate(records):
        if kind != "engine.rebalance":
            continue
        after = [k for k, _ in records[i + 1 :]]
        first_serve = after.index("engine.serve") if "engine.serve" in after else len(after)
        first_done = after.index("eplb.rearranged")
        if first_serve < first_done:
            overlapped += 1
        else:
            drained += 1
    # Periodic rebalances at steps 125 and 625 (EP2), the reshuffle after the scale-up's commit and 1520, 2020,
    # 2520 (EP4) overlap serving; the last one at step 3000 drains first.
    assert (overlapped, drained) == (6, 1)


def _arrivals(cluster, suffix: str) -> dict[tuple[str, int], int]:
    """Collectives each pid joined on each group whose name ends with ``suffix``."""
    counts: dict[tuple[str, int], int] = {}
    for _, kind, f in cluster.kernel.history.records:
        if kind == "collective.arrive" and f["group"].endswith(suffix):
            counts[f["group"], f["pid"]] = counts.get((f["group"], f["pid"]), 0) + 1
    return counts


@pytest.mark.parametrize("lag", [None, 0.12])
def test_async_eplb_takes_a_layer_only_when_every_rank_has_it(lag) -> None:
    """While a rebalance is in flight, vLLM's main thread all-reduces after every forward step, on the EP group,
    whether its async thread has staged the layer, and every rank takes it (move_from_buffer) only when all have;
    the async thread all-reduces a coordinated stop on the EPLB group before each layer."""
    faults = [] if lag is None else [f"device.stream_lag:delay_s={lag},rank=1"]
    cluster = _async_run("scale-up", faults, SYNCED)
    assert cluster.oracles.verdict()[0] == "pass"
    ready = _arrivals(cluster, "/ep")
    per_group = {g: {n for (g2, _), n in ready.items() if g2 == g} for g, _ in ready}
    assert all(len(counts) == 1 for counts in per_group.values()), ready  # every member, every step
    steps = {g: counts.pop() for g, counts in per_group.items()}
    if lag is None:
        # 4 layers, each staged within the step (a READ takes about a millisecond, a step 50 ms): one step per layer
        # for the two rebalances of EP2 and the four that overlap serving on EP4; the last rebalance is drained
        # (vLLM 0.33.0's drain_async: the same all_reduce every millisecond until each layer is staged).
        assert steps["eplb#0/ep"] == 8 and steps["eplb#1/ep"] > 16
    else:
        # rank 1's stream runs its copies 0.12 s late, so it stages each layer steps after the others, and
        # nobody takes the layer before it: more steps, the same on every rank, and the weights are right.
        assert steps["eplb#0/ep"] > 8 and steps["eplb#1/ep"] > 16
    # On the EPLB group async EPLB adds one coordinated stop per layer to what synchronous EPLB does (the load
    # all-reduce, one execute barrier per layer): 4 layers x 2 rebalances on EP2, x 5 on EP4; none stops.
    eplb = {key: n for key, n in _arrivals(cluster, "").items() if not key[0].endswith("/ep")}
    sync = _arrivals(_async_run("scale-up", faults, SYNCED, use_async=False), "")
    assert {key: n - sync[key] for key, n in eplb.items()} == {
        **{("eplb#0", p): 8 for p in (0, 1)},
        **{("eplb#1", p): 20 for p in (0, 1, 2, 3)},
    }
    assert not [f for _, kind, f in cluster.kernel.history.records if kind == "eplb.stopped"]


@pytest.mark.parametrize("use_async", [False, True])
def test_aborting_a_scale_down_while_layers_move_drains_every_member(use_async) -> None:
    """An abort reaches only the ranks that were to stay; with a rebalance in flight (30 layers from step 125, the
    abort's PREPARE from step 126) the ranks a scale-down would have removed must drain too, since only a rank's
    own main thread takes its staged layers (else they hold everyone's next collective)."""
    layers: dict[str, Any] = {"model.layers": 30}  # a dotted key: not a Python name
    cluster = _async_run(
        "scale-down",
        use_async=use_async,
        **layers,
        timeline=[{"at_step": 126, "kind": "abort", "to": 2, "prepare_s": 0.1}],
        lifecycle="pr-53947",
    )
    assert cluster.oracles.verdict() == ("pass", None, None)
    moved_async = {
        f["pid"]
        for _, kind, f in cluster.kernel.history.records
        if kind == "thread.start" and f["thread"].startswith("eplb-async@")
    }
    assert moved_async == ({0, 1, 2, 3} if use_async else set())  # the rebalance did run on async threads


def test_a_rank_dying_mid_rebalance_stops_the_run_at_once_and_closes_its_groups() -> None:
    """Rank 3 dies one step into an async rebalance, while each survivor's async thread waits for it in the EPLB
    group's collectives.  As on gloo, its death closes both of its groups (their collectives fail at once with
    "connection closed by peer" instead of at the 300 s timeout), and the engine, whose next command goes to the
    dead rank too, stops at that instant naming it (rather than going on for 300 simulated seconds)."""
    cluster = _async_run("rank-failure", timeline=[{"at_step": 626, "kind": "fail_rank", "rank": 3}])
    verdict, invariant, detail = cluster.oracles.verdict()
    assert (verdict, invariant) == ("liveness", "stuck")
    assert detail.startswith(
        "serving steps 626..925: pids [3] were killed and will never answer: pid 3: worker@3 "
        "killed on waiting for the engine, eplb-async@3 killed"
    )
    records = cluster.kernel.history.records
    killed = next(t for t, kind, _ in records if kind == "process.kill")
    assert cluster.oracles.first_problem().t == killed == cluster.kernel.now()
    waiting = {
        f["pid"] for t, kind, f in records if kind == "collective.arrive" and f["group"] == "eplb#0" and f["seq"] == 14
    }
    assert waiting == {0, 1, 2}  # the survivors' async threads were in the EPLB group's collective when it died
    from fakes import torch_dist

    groups = {g.name: g.broken for ref in torch_dist._live[cluster.kernel] if (g := ref()) is not None}
    assert groups["eplb#0"] == groups["eplb#0/ep"] == "pid 3 was killed"
    cluster.kernel.close()


@pytest.mark.parametrize("rank", [None, 1, 3])
def test_a_nixl_fault_for_one_rank_fires_only_in_that_rank_s_agents(rank) -> None:
    """``rank=N`` on a nixl.* site: only transfers that rank process N initiates are late; without it, every rank's."""
    from sim.cluster import Cluster
    from sim.faults import parse

    spec = "nixl.xfer.late:delay=0.5" + ("" if rank is None else f",rank={rank}")
    c = Cluster(load("scale-up"), seed=0, strategy="shared-agent", profile="dram", faults=[parse(spec)])
    c.run()
    pid_of = {f["agent"]: f["pid"] for _, kind, f in c.kernel.history.records if kind == "nixl.agent.create"}
    fired = {pid_of[agent] for site, agent, _, _ in c.fabric.faults.fired}
    c.kernel.close()
    assert fired == ({0, 1, 2, 3} if rank is None else {rank})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_builtin_strategy_sends_nixl_notifications(strategy: str) -> None:
    """What `epsim faults` and docs/sweeps.md say of the notif sites: armed, they never fire with the built-ins."""
    r = run("elastic-cycle", strategy=strategy, faults=["nixl.notif.drop", "nixl.notif.delay:delay=0.5"])
    assert r.faults_fired == {"nixl.notif.drop": 0, "nixl.notif.delay:delay=0.5": 0}


@pytest.mark.parametrize(
    "fault, strategy, verdict, fired",
    [
        ("gc.late:at_step=1010", "per-communicator-agent", "pass", 2),  # the old communicators dropped at the commit
        ("nixl.xfer.late:at_step=1010,delay=0.5", "shared-agent", "pass", 132),  # every READ from the reshuffle on
        ("storage.move:at_step=1010", "shared-agent", "crash", 2),  # the buffer moved under PREPARE's new communicator
    ],
)
def test_a_fault_due_while_an_elastic_event_serves_applies_to_the_event(fault, strategy, verdict, fired) -> None:
    """scale-up starts PREPARE at step 1000 and serves in short chunks until it commits at step 1020; a fault due at
    step 1010 applies from there on (rather than waiting for the event to end, and never firing)."""
    r = run("scale-up", strategy=strategy, faults=[fault])
    assert (r.verdict, r.faults_fired) == (verdict, {fault: fired})


@pytest.mark.parametrize("at_step, fired", [(1011, 2), (1020, 2), (1021, 0)])
def test_a_prepare_fault_is_decided_for_the_step_the_window_ends_at_on_every_seed(at_step, fired) -> None:
    """scale-up's PREPARE serves steps 1000..1020 (prepare_s 1.0 s of 0.05 s steps) and builds at step 1020.  A
    storage.move due in the window's last serving chunk (1011..1020) fired on both ranks, on one or on none,
    by seed: the engine's step count and the PREPARE's wake-up fall on one instant, and the tie-break decided which
    came first (seen as 4 of 12 seeds firing on one rank, 8 on none)."""
    for seed in range(8):
        fault = f"storage.move:at_step={at_step}"
        assert run_scenario(load("scale-up"), seed=seed, faults=[fault]).faults_fired == {fault: fired}, seed


def test_a_nixl_fault_armed_from_the_start_meets_the_first_registrations() -> None:
    """Without at_step a fault is armed before the ranks start, so their first registration can fail (found by
    review: it was armed right after it)."""
    r = run("steady", strategy="per-communicator-agent", faults=["nixl.register.fail"])
    assert (r.verdict, r.faults_fired) == ("crash", {"nixl.register.fail": 2})
    assert r.detail.endswith("nixlBackendError: NIXL_ERR_BACKEND")


@pytest.mark.parametrize(
    "overrides",
    [
        {"serving": {"step_time_s": 0.25, "drift_every_steps": 0}, "eplb": {"step_interval": 3000}, "steps": 6000},
        {"timeline": [{"at_step": 1000, "kind": "scale_up", "to": 4, "prepare_s": 700.0}]},
    ],
)
def test_long_serving_chunks_and_long_prepares_are_no_liveness_failure(overrides) -> None:
    """A serving chunk of 3000 steps x 0.25 s, or a PREPARE of 700 s, is longer than the 660 s a command may
    overrun; the limit counts on top of what the command itself takes (so neither is `stuck`)."""
    sc = load("steady" if "steps" in overrides else "scale-up")
    r = run_scenario(with_overrides(sc, **overrides))
    assert r.verdict == "pass", r.detail


def test_the_load_window_holds_exactly_the_last_window_steps(monkeypatch) -> None:
    """vLLM's load window is a ring buffer of ``window`` forward steps: at every periodic rebalance and the last one
    the policy sees the load of exactly that many steps (serving splits its chunk where the window starts), which
    is every routed token-slot of the group: window x tokens_per_step x top_k x ranks in every layer."""
    from sim.cluster import Cluster
    from sim.eplb import policy

    sc = load("steady")
    seen, real = [], policy.rebalance

    def spy(load_, *args, **kwargs):
        seen.append(int(load_.sum()))
        return real(load_, *args, **kwargs)

    monkeypatch.setattr(policy, "rebalance", spy)
    c = Cluster(sc, seed=0, strategy="shared-agent", profile="dram")
    c.run()
    serve_starts = {f["step"] for _, kind, f in c.kernel.history.records if kind == "engine.serve"}
    rebalances = [f["step"] for _, kind, f in c.kernel.history.records if kind == "engine.rebalance"]
    c.kernel.close()
    window, s = sc.eplb.window, sc.serving
    assert rebalances == [125, 625, 1125, 1625, 2125, 2625, 3000]
    assert all(step - window in serve_starts for step in rebalances if step > window)
    per_step = s.tokens_per_step * s.top_k * sc.ranks * sc.model.layers
    assert seen[1:] == [window * per_step] * (len(rebalances) - 1)
    assert seen[0] == 125 * per_step  # the first comes before a window has passed


def test_routed_shares_never_exceed_one_over_top_k() -> None:
    """A token routes to top_k distinct experts, so no expert gets more than 1/top_k of the token-slots; below the
    cap the shares keep the popularity's proportions."""
    import numpy as np

    from sim.engine import routed_shares

    zipf = np.arange(1, 257, dtype=np.float64) ** -1.2
    shares = routed_shares(zipf, 8)
    assert shares.sum() == pytest.approx(1.0) and shares.max() == pytest.approx(1 / 8)
    assert (shares[:2] == pytest.approx(1 / 8)) and shares[2] < 1 / 8  # DeepSeek-V3's skew caps two experts
    assert shares[5] / shares[9] == pytest.approx(zipf[5] / zipf[9])
    assert routed_shares(zipf[:8], 2) == pytest.approx(zipf[:8] / zipf[:8].sum())  # under the cap: unchanged
    assert routed_shares(np.ones(4), 4) == pytest.approx([0.25] * 4)


@pytest.mark.parametrize("factory", ["finalizer_raises", "crash_with_repr", "jitter"])
def test_addresses_random_and_ns_clocks_do_not_reach_the_history(factory: str) -> None:
    """A finalizer's repr, an exception quoting an object's repr, the random module and the _ns clocks could make
    the same seed hash differently in another process; none reaches the history, so two fresh processes agree."""
    import json
    import os
    import subprocess
    import sys

    here = run("scale-up", strategy=f"tests.strategies.unruly:{factory}")  # this process: other addresses
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sim.cli",
            "run",
            "scale-up",
            "--json",
            "--strategy",
            f"tests.strategies.unruly:{factory}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONHASHSEED": "1"},
    )
    there = json.loads(done.stdout.strip().splitlines()[-1])
    assert there["trace_hash"] == here.trace_hash
    assert "0x7" not in (there["detail"] or "") and "0x5" not in (there["detail"] or "")
    if factory == "crash_with_repr":
        assert there["verdict"] == "crash" and "0x…" in there["detail"]
