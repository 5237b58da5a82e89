"""Fake torch.distributed groups inside the kernel: unmodified torch.distributed calls, timeouts naming ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fakes import torch_dist
from fakes.torch_dist import CollectiveMismatch, CollectiveTimeout, Rendezvous
from sim.kernel import Kernel


def world(n: int, timeout: float = 300.0):
    k = Kernel(seed=0)
    groups = Rendezvous(k, "eplb#0", list(range(10, 10 + n)), timeout).groups()
    return k, groups


def test_unmodified_torch_distributed_calls_run_on_fake_groups() -> None:
    k, groups = world(3)
    out = {}

    def rank_main(g):
        gathered = [None] * g.size()
        dist.all_gather_object(gathered, {"rank": g.rank()}, group=g)
        t = torch.tensor([float(g.rank() + 1)])
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=g)
        objs = [f"from {g.rank()}"]
        dist.broadcast_object_list(objs, group_src=1, group=g)
        dist.barrier(group=g)
        out[g.rank()] = (gathered, t.item(), objs, dist.get_rank(g), dist.get_world_size(g), k.now())

    with torch_dist.installed():
        for g in groups:
            k.spawn(f"r{g.rank()}", rank_main, g, pid=10 + g.rank())
        k.run()
    assert out[2] == ([{"rank": 0}, {"rank": 1}, {"rank": 2}], 6.0, ["from 1"], 2, 3, 0.0)
    assert out[0][0] == out[1][0] == out[2][0]
    assert dist.all_gather_object.__module__ == "torch.distributed.distributed_c10d"  # restored


def test_results_are_copies_not_shared_objects() -> None:
    k, groups = world(2)
    got = []

    def rank_main(g):
        payload = {"list": [g.rank()]}
        gathered = [None, None]
        torch_dist.all_gather_object(gathered, payload, group=g)
        gathered[g.rank()]["list"].append("mutated")
        got.append(payload)

    for g in groups:
        k.spawn(f"r{g.rank()}", rank_main, g)
    k.run()
    assert got == [{"list": [0]}, {"list": [1]}] or got == [{"list": [1]}, {"list": [0]}]


def test_a_member_that_never_arrives_times_out_naming_it() -> None:
    k, groups = world(3, timeout=300.0)
    errors = {}

    def rank_main(g):
        try:
            torch_dist.barrier(group=g)
        except CollectiveTimeout as exc:
            errors[g.rank()] = (exc.missing, str(exc), k.now())

    for g in groups[:2]:  # rank 2 never calls the barrier
        k.spawn(f"r{g.rank()}", rank_main, g, pid=10 + g.rank())
    k.run()
    assert errors[0][0] == errors[1][0] == [2]
    assert errors[0][2] == 300.0
    assert "barrier #0 on group eplb#0 timed out after 300 s: ranks [2] (pids [12]) never arrived" == errors[0][1]
    assert [f["missing"] for _, kind, f in k.history.records if kind == "collective.timeout"] == [[12], [12]]


def test_async_all_reduce_waits_in_simulated_time() -> None:
    k, groups = world(2)
    done = []

    def rank_main(g, delay):
        k.sleep(delay)
        t = torch.ones(2)
        work = torch_dist.all_reduce(t, group=g, async_op=True)
        work.wait()
        done.append((g.rank(), t.tolist(), k.now()))

    k.spawn("a", rank_main, groups[0], 1.0)
    k.spawn("b", rank_main, groups[1], 4.0)
    k.run()
    assert sorted(done) == [(0, [2.0, 2.0], 4.0), (1, [2.0, 2.0], 4.0)]


def test_mismatched_collectives_are_reported() -> None:
    k, groups = world(2)
    seen = []

    def a(g):
        torch_dist.barrier(group=g)

    def b(g):
        k.sleep(1.0)  # arrive second
        with pytest.raises(CollectiveMismatch):
            torch_dist.all_gather_object([None, None], 1, group=g)
        seen.append("mismatch")

    k.spawn("a", a, groups[0])
    k.spawn("b", b, groups[1])
    k.run()
    assert seen == ["mismatch"]
