"""Fake torch.distributed groups inside the kernel: unmodified torch.distributed calls, timeouts naming ranks."""

from __future__ import annotations

import collections

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


class _Box:
    def __init__(self, value) -> None:
        self.value = value

    def __eq__(self, other) -> bool:
        return isinstance(other, _Box) and other.value == self.value


def test_every_rank_gets_its_own_containers_and_aliasing_survives() -> None:
    """What one rank mutates no other rank sees; a contribution that holds one list twice arrives holding one list
    twice; other objects (and a structure holding one) are copied whole."""
    k, groups = world(3)
    got = {}

    def rank_main(g):
        shared = [g.rank()]
        payload = {"meta": {(0, 1): (100 * g.rank(), 8, 0)}, "twice": [shared, shared], "box": _Box([g.rank()]),
                   "ordered": collections.OrderedDict(a=g.rank())}
        gathered = [None] * 3
        torch_dist.all_gather_object(gathered, payload, group=g)
        got[g.rank()] = gathered
        k.sleep(0)  # everyone has their copy before anyone mutates it
        gathered[0]["meta"][(9, 9)] = "mine"
        gathered[0]["twice"][0].append("mine")
        gathered[0]["box"].value.append("mine")

    for g in groups:
        k.spawn(f"r{g.rank()}", rank_main, g)
    k.run()
    for r, gathered in got.items():
        assert gathered[1]["meta"] == {(0, 1): (100, 8, 0)} and gathered[1]["box"] == _Box([1])
        assert type(gathered[1]["ordered"]) is collections.OrderedDict
        assert gathered[0]["twice"][0] is gathered[0]["twice"][1]  # aliasing inside one contribution kept
        assert gathered[0]["twice"][0] == [0, "mine"] and gathered[0]["box"].value == [0, "mine"]
        assert gathered[0]["meta"][(9, 9)] == "mine"
    a, b = got[0][1], got[1][1]
    assert a["meta"] is not b["meta"] and a["box"] is not b["box"] and a["twice"][0] is not b["twice"][0]


def test_copier_rebuilds_containers_and_shares_immutable_leaves() -> None:
    """The per-result copier: every call a new list or dict around the same immutable leaves (every rank's copy of
    every rank's metadata at EP256, at C speed), pickle for anything it cannot rebuild."""
    meta = [{(layer, t): (1000 * r + layer, 8, 0) for layer in range(3) for t in range(2)} for r in range(4)]
    copy = torch_dist._copier(meta)
    one, two = copy(), copy()
    assert one == two == meta
    assert one is not meta and all(x is not y for x, y in zip(one, meta)) and one[0] is not two[0]
    assert one[0][(0, 0)] is meta[0][(0, 0)]
    nested = {"a": [1, [2, 3]], "b": (1, (2, "x")), "c": frozenset({1, 2})}
    got = torch_dist._copier(nested)()
    assert got == nested and got["a"] is not nested["a"] and got["a"][1] is not nested["a"][1]
    assert got["b"] is nested["b"]
    mutable_leaf = [(1, [2])]  # a tuple holding a list is not immutable: copied through pickle
    got = torch_dist._copier(mutable_leaf)()
    assert got == mutable_leaf and got[0][1] is not mutable_leaf[0][1]


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
