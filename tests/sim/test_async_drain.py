"""Async EPLB's drain and postponement, as each lifecycle revision has them (docs/simulation.md).

vLLM 0.33.0: a rebalance that comes due while one is in flight is postponed until the last layer is in
(``EplbState.step``); ``drain_async`` runs only before the scale-up's commit and the scale-down's reshuffle, as an
all_reduce over the EP group each round.  pr-53947 (the revision epsim modelled first) drains each rank alone, at
the next rebalance, commit, abort and exit.
"""

from __future__ import annotations

import pytest

from sim import worker as worker_mod
from sim.cluster import Cluster
from sim.run import run_scenario
from sim.scenario import load, with_overrides


def steady_async(lifecycle: str):
    # Rebalances every 2 steps of a 4-layer model that lands a layer per step: each comes due while one is in flight.
    return with_overrides(
        load("steady"),
        **{"eplb.use_async": True, "eplb.step_interval": 2, "eplb.window": 2, "steps": 40, "lifecycle": lifecycle},
    )


def records(sc, kind: str) -> list[dict]:
    c = Cluster(sc, seed=0, strategy="per-communicator-agent", profile="dram")
    c.run()
    return [dict(f, t=t) for t, k, f in c.kernel.history.records if k == kind]


def test_a_rebalance_due_while_one_is_in_flight_waits_for_it_under_0_33_0() -> None:
    postponed = records(steady_async("0.33.0"), "eplb.postponed")
    assert postponed, "no rebalance was postponed"
    # The takes are in lockstep, so every rank waits the same steps at the same moments.
    by_time: dict[float, set] = {}
    for rec in postponed:
        by_time.setdefault(rec["t"], set()).add((rec["pid"], rec["steps"]))
    assert all({pid for pid, _ in v} == {0, 1} and len({s for _, s in v}) == 1 for v in by_time.values())
    assert records(steady_async("pr-53947"), "eplb.postponed") == []
    for lifecycle in ("0.33.0", "pr-53947"):
        r = run_scenario(steady_async(lifecycle), seed=0, strategy="per-communicator-agent", profile="dram")
        assert r.verdict == "pass", (lifecycle, r.detail)


def in_flight_at_commit(lifecycle: str):
    # 32 layers, one a step: the rebalance started at step 995 is still moving when the scale-up commits (~1020).
    return with_overrides(
        load("scale-up"),
        **{"eplb.use_async": True, "model.layers": 32, "eplb.first_rebalance_step": 995, "lifecycle": lifecycle},
    )


@pytest.fixture
def takes(monkeypatch):
    """Every layer a main thread takes: (pid, layer, time, whether it was inside a drain)."""
    seen: list[tuple[int, int, float, bool]] = []
    draining: set[int] = set()
    take, drain, commit = worker_mod.Worker._take_layer, worker_mod.Worker.do_drain, worker_mod.Worker.do_commit

    def spy_take(self):
        seen.append((self.pid, self.pending[0], self.kernel.now(), self.pid in draining))
        return take(self)

    def spy_drain(self):
        draining.add(self.pid)
        try:
            return drain(self)
        finally:
            draining.discard(self.pid)

    def spy_commit(self):
        seen.append((self.pid, -1, self.kernel.now(), False))  # layer -1: the commit starts
        return commit(self)

    monkeypatch.setattr(worker_mod.Worker, "_take_layer", spy_take)
    monkeypatch.setattr(worker_mod.Worker, "do_commit", spy_commit)
    monkeypatch.setattr(worker_mod.Worker, "do_drain", spy_drain)
    return seen


def test_0_33_0_drains_over_the_ep_group_before_the_scale_up_commit(takes) -> None:
    sc = in_flight_at_commit("0.33.0")
    r = run_scenario(sc, seed=0, strategy="per-communicator-agent", profile="dram")
    assert r.verdict == "pass", r.detail
    swaps = {pid: t for pid, layer, t, _ in takes if layer == -1}
    drained = [t for t in takes if t[3] and t[2] <= max(swaps.values())]  # (not the run's last rebalance)
    assert drained, "nothing was in flight at the commit"
    assert {pid for pid, *_ in drained} == {0, 1}
    # Lockstep: both old ranks take each drained layer at the same moment, and before their commit.
    by_layer: dict[int, set] = {}
    for pid, layer, t, _ in drained:
        by_layer.setdefault(layer, set()).add(t)
        assert t <= swaps[pid]
    assert all(len(times) == 1 for times in by_layer.values())
    assert max(by_layer) == sc.model.layers - 1  # the drain ends with the last layer


def test_the_later_revision_drains_each_rank_alone_inside_its_commit(takes) -> None:
    r = run_scenario(in_flight_at_commit("pr-53947"), seed=0, strategy="per-communicator-agent", profile="dram")
    assert r.verdict == "pass", r.detail
    commit = min(t for _, layer, t, _ in takes if layer == -1)
    before = [t for t in takes if 0 <= t[1] and t[2] <= commit]
    assert before and not [t for t in before if t[3]]  # no drain command: the commit's own join takes what is left


def test_0_33_0_drains_every_old_rank_before_the_scale_down_reshuffle(takes) -> None:
    """The departing ranks too (perform_scale_down_eplb_reshuffle runs on every old rank), in lockstep."""
    sc = with_overrides(
        load("scale-down"), **{"eplb.use_async": True, "model.layers": 32, "eplb.first_rebalance_step": 995}
    )
    r = run_scenario(sc, seed=0, strategy="per-communicator-agent", profile="dram")
    assert r.verdict == "pass", r.detail
    commit = min(t for _, layer, t, _ in takes if layer == -1)
    drained = [t for t in takes if t[3] and t[2] <= commit]
    assert {pid for pid, *_ in drained} == {0, 1, 2, 3}
    assert max(layer for _, layer, *_ in drained) == sc.model.layers - 1
    by_layer: dict[int, set] = {}
    for _, layer, t, _ in drained:
        by_layer.setdefault(layer, set()).add(t)
    assert all(len(times) == 1 for times in by_layer.values())
