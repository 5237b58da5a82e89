"""The calibrated time model: costs measured with n rank processes on a host, charged at the live rank count.

The measurements themselves run on the real NIXL (tests/real/test_calibrate.py); here the model is given known
numbers and each cost must show up where the simulation charges it, and nowhere else.
"""

from __future__ import annotations

import pytest
import torch

from fakes.nixl import FakeFabric, TimeModel, _api, use_fabric
from real_backends.calibrate import as_real_runs, comparison_scenario
from real_backends.host_load import fit_rounds
from sim import scenario as scenario_mod
from sim.calibration import LOAD_COSTS, Calibration, HostLoad
from sim.run import run_scenario

ZERO = dict.fromkeys(
    (
        "connect_s",
        "collective_s",
        "first_agent_s",
        "agent_s",
        "register_s",
        "first_remote_setup_s",
        "remote_setup_s",
        "collect_s",
        "gather_s",
        "command_s",
        "teardown_s",
        "stall_s",
        "copy_latency_s",
        "post_s",
        "group_s",
    ),
    0.0,
)


def row(ranks: int, **costs: float) -> HostLoad:
    return HostLoad(**{**ZERO, "ranks": ranks, "xfer_latency_s": 1e-5, "bandwidth_Bps": 1e10, **costs})


def calibration(*rows: HostLoad) -> Calibration:
    return Calibration(xfer_latency_s=1e-5, bandwidth_Bps=1e10, loaded=list(rows))


def spans(result, kind: str) -> list[float]:
    return [b - a for what, a, b in result.spans if what == kind]


def test_costs_take_the_row_for_the_rank_count_and_the_line_between_and_beyond_rows():
    cal = calibration(row(2, collect_s=0.1, bandwidth_Bps=4e9), row(4, collect_s=0.3, bandwidth_Bps=2e9))
    assert cal.costs(2)["collect_s"] == pytest.approx(0.1) and cal.costs(1)["collect_s"] == pytest.approx(0.1)
    assert cal.costs(3)["collect_s"] == pytest.approx(0.2)  # between two measured counts
    assert cal.costs(6)["collect_s"] == pytest.approx(0.5)  # along the last two beyond them
    # bandwidth goes as seconds per byte: what grows with the processes sharing the cores
    assert cal.costs(3)["seconds_per_byte"] == pytest.approx((1 / 4e9 + 1 / 2e9) / 2)
    shrinking = calibration(row(2, gather_s=0.01), row(3, gather_s=0.002))
    assert shrinking.costs(8)["gather_s"] == 0.0  # never below zero
    assert set(cal.costs(3)) == set(LOAD_COSTS)


def test_a_calibration_without_rows_gives_its_two_process_numbers_and_charges_no_call():
    legacy = Calibration(xfer_latency_s=2e-5, bandwidth_Bps=5e9, collective_latency_s=1e-4, collect_s=0.05)
    c = legacy.costs(3)
    assert (c["xfer_latency_s"], c["collective_s"], c["collect_s"]) == (2e-5, 1e-4, 0.05)
    assert c["first_agent_s"] == c["stall_s"] == c["teardown_s"] == 0.0


def test_fit_rounds_recovers_the_transfer_model_and_drops_a_negative_term():
    latency, post, bandwidth, collective = 3e-4, 2e-4, 2.5e9, 4e-4
    rounds = [
        (k, b, collective + latency + k * post + k * b / bandwidth)
        for k in (1, 2, 4)
        for b in (1 << 18, 1 << 20, 1 << 22)
    ]
    got = fit_rounds(rounds, collective)
    assert got == pytest.approx((latency, post, bandwidth), rel=1e-6)
    # rounds that shrink with more READs (noise) fit no negative per-READ cost
    odd = [(1, 1 << 20, 2e-3), (2, 1 << 20, 1.5e-3), (4, 1 << 20, 1.4e-3), (4, 1 << 22, 3e-3)]
    assert all(v >= 0 for v in fit_rounds(odd, 0.0))
    with pytest.raises(ValueError, match="three round shapes"):
        fit_rounds([(1, 1, 1.0), (2, 1, 2.0)], 0.0)


def test_the_fake_nixl_holds_each_call_for_its_host_time():
    spent: list[tuple[str, float]] = []
    model = TimeModel(
        first_agent_s=0.4, agent_s=0.02, register_s=0.001, first_remote_setup_s=0.03, remote_setup_s=0.0005
    )
    fabric = FakeFabric(time_model=model)
    fabric.spend = lambda seconds, why: spent.append((why, seconds))
    with use_fabric(fabric):
        a = _api.nixl_agent("A")
        b = _api.nixl_agent("B")  # the process's second agent: UCX is loaded already
        a.register_memory(torch.zeros(16))
        c = _api.nixl_agent("C")
        b.add_remote_agent(a.get_agent_metadata())
        b.add_remote_agent(c.get_agent_metadata())
    assert spent == [
        ("creating a NIXL agent", 0.4),
        ("creating a NIXL agent", 0.02),
        ("registering memory", 0.001),
        ("creating a NIXL agent", 0.02),
        ("loading a remote agent", 0.03),
        ("loading a remote agent", 0.0005),
    ]


def test_a_reads_own_cost_takes_its_turn_on_the_initiators_link():
    fabric = FakeFabric(clock=lambda: 0.0, time_model=TimeModel(xfer_latency_s=1e-4, bandwidth_Bps=1e9, post_s=1e-3))
    first = fabric.xfer_duration(1_000_000, "READ", True, pid=1)
    second = fabric.xfer_duration(1_000_000, "READ", True, pid=1)
    assert first == pytest.approx(1e-4 + 1e-3 + 1e-3)  # latency, its own cost, its bytes
    assert second == pytest.approx(first + 1e-3 + 1e-3)  # after the first on the link: latency overlapped
    assert fabric.xfer_duration(1_000_000, "READ", True, pid=2) == pytest.approx(first)  # another process's link


def test_each_calibrated_cost_shows_up_in_its_phase():
    sc = as_real_runs(comparison_scenario("scale-up", 2, 3, 2, 1 << 16))
    plain = run_scenario(sc, calibration=calibration(row(1)))
    costly = calibration(row(1, first_agent_s=0.5, group_s=0.1, collect_s=0.1, first_remote_setup_s=0.05))
    slow = run_scenario(sc, calibration=costly)
    assert slow.verdict == plain.verdict == "pass"
    # the joining rank's group and first agent decide PREPARE; COMMIT collects twice (vLLM 0.33.0)
    assert spans(slow, "scale_up.prepare")[0] == pytest.approx(0.6) and spans(plain, "scale_up.prepare")[0] < 0.1
    assert spans(slow, "scale_up.commit")[0] == pytest.approx(0.2)
    # a new communicator's first rebalance loads its peers (the joining rank's agent its first)
    assert spans(slow, "scale_up.reshuffle")[0] - spans(plain, "scale_up.reshuffle")[0] >= 0.05
    assert spans(slow, "rebalance")[0] - spans(plain, "rebalance")[0] == pytest.approx(0.05)
    # every rebalance's collectives wait the stall: the load all_reduce and each of the two layers' barriers
    stalled = run_scenario(sc, calibration=calibration(row(1, stall_s=0.01)))
    assert [a - b for a, b in zip(spans(stalled, "rebalance"), spans(plain, "rebalance"))] == pytest.approx([0.03] * 6)
    again = run_scenario(sc, calibration=costly)
    assert (again.trace_hash, again.spans) == (slow.trace_hash, slow.spans)  # deterministic with costs too


def test_the_stall_grows_with_the_live_ranks_and_a_collection_with_the_ranks_collecting():
    sc = as_real_runs(comparison_scenario("scale-up", 2, 3, 2, 1 << 16))
    cal = calibration(row(2, stall_s=0.002, collect_s=0.1), row(3, stall_s=0.004, collect_s=0.2))
    r = run_scenario(sc, calibration=cal)
    before, after = spans(r, "rebalance")[1], spans(r, "rebalance")[-1]  # 2 ranks, then 3 (no remote setup)
    assert after > before
    # three ranks alive at COMMIT, but only the two old ones commit, and collect (twice) at once
    assert spans(r, "scale_up.commit")[0] == pytest.approx(2 * 0.1, rel=0.05)


def test_a_departing_rank_exits_after_its_collection_and_its_teardown():
    sc = as_real_runs(comparison_scenario("scale-down", 3, 2, 2, 1 << 16))
    r = run_scenario(
        sc, strategy="per-communicator-agent", calibration=calibration(row(1, collect_s=0.05, teardown_s=0.3))
    )
    assert r.verdict == "pass" and spans(r, "scale_down.exit")[0] == pytest.approx(0.35)


def test_row_copies_take_host_time_only_where_the_weights_are_in_host_memory():
    sc = as_real_runs(comparison_scenario("scale-up", 2, 3, 2, 1 << 20))
    copying = calibration(row(1, copy_latency_s=1e-3, copy_Bps=1e9))
    dram, cuda = (run_scenario(sc, profile=p, calibration=copying) for p in ("dram", "cuda"))
    bare = run_scenario(sc, profile="dram", calibration=calibration(row(1)))
    assert sum(spans(dram, "rebalance")) > sum(spans(bare, "rebalance")) + 0.01
    assert spans(cuda, "rebalance") == pytest.approx(spans(bare, "rebalance"))  # queued on a stream on a GPU


def test_a_command_reaches_the_ranks_one_after_another():
    sc = scenario_mod.load("steady")
    gap = run_scenario(sc, calibration=calibration(row(1, command_s=0.01)))
    none = run_scenario(sc, calibration=calibration(row(1)))
    # two ranks: the second gets each command 10 ms after the first, and the load all_reduce waits for it
    extra = [a - b for a, b in zip(spans(gap, "rebalance"), spans(none, "rebalance"))]
    assert len(extra) >= 5 and extra == pytest.approx([0.01] * len(extra))
