"""Fake torch.distributed groups inside the kernel: unmodified torch.distributed calls, timeouts naming ranks."""

from __future__ import annotations

import collections
import pickle
from typing import Any

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
        out[g.rank()] = (gathered, t.item(), objs, g.rank(), dist.get_world_size(g), k.now())

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
        k.spawn(f"r{g.rank()}", rank_main, g, pid=10 + g.rank())
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
        payload = {
            "meta": {(0, 1): (100 * g.rank(), 8, 0)},
            "twice": [shared, shared],
            "box": _Box([g.rank()]),
            "ordered": collections.OrderedDict(a=g.rank()),
        }
        gathered: list[Any] = [None] * 3
        torch_dist.all_gather_object(gathered, payload, group=g)
        got[g.rank()] = gathered
        k.sleep(0)  # everyone has their copy before anyone mutates it
        gathered[0]["meta"][(9, 9)] = "mine"
        gathered[0]["twice"][0].append("mine")
        gathered[0]["box"].value.append("mine")

    for g in groups:
        k.spawn(f"r{g.rank()}", rank_main, g, pid=10 + g.rank())
    k.run()
    for gathered in got.values():
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
    nested: dict[str, Any] = {"a": [1, [2, 3]], "b": (1, (2, "x")), "c": frozenset({1, 2})}
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

    k.spawn("a", rank_main, groups[0], 1.0, pid=10)
    k.spawn("b", rank_main, groups[1], 4.0, pid=11)
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

    k.spawn("a", a, groups[0], pid=10)
    k.spawn("b", b, groups[1], pid=11)
    k.run()
    assert seen == ["mismatch"]


def _spawn_all(k, groups, body):
    out: dict[int, tuple[Any, ...]] = {}

    def main(g):
        try:
            out[g.rank()] = ("ok", body(g))
        except Exception as exc:  # noqa: BLE001 - the test compares what each rank saw
            out[g.rank()] = (type(exc).__name__, str(exc), k.now())

    for g in groups:
        k.spawn(f"r{g.rank()}", main, g, pid=10 + g.rank())
    k.run()
    return [out[r] for r in sorted(out)]


def test_stateless_groups_refuse_get_rank_and_a_global_src_as_torch_does() -> None:
    # vLLM's elastic EP groups are stateless ProcessGroups, never registered in torch's world map (checked on gloo).
    k, groups = world(2)

    def body(g):
        with pytest.raises(ValueError, match="is not registered, please create group with torch.distributed.new_group"):
            torch_dist.get_rank(g)
        for kwargs in ({"src": 0}, {}):
            with pytest.raises(ValueError, match="is not initialized in the world group map"):
                torch_dist.broadcast_object_list(["x"], group=g, **kwargs)
        with pytest.raises(ValueError, match="Can't specify both"):
            torch_dist.broadcast_object_list(["x"], src=0, group_src=0, group=g)
        with pytest.raises(ValueError, match="Group rank 5 is not part of group"):
            torch_dist.broadcast_object_list(["x"], group_src=5, group=g)
        mine = [object()] if g.rank() == 0 else [None]
        keep = mine[0]
        torch_dist.broadcast_object_list(mine, group_src=0, group=g)  # refused calls issued nothing
        return mine[0] is keep, torch_dist.get_world_size(g)

    got = _spawn_all(k, groups, body)
    assert got[0] == ("ok", (True, 2))  # the source keeps its own objects
    assert got[1] == ("ok", (False, 2))  # the others receive copies


@pytest.mark.parametrize("case", ["shape", "dtype", "list_length", "root"])
def test_contributions_that_do_not_fit_fail_every_member_at_once(case: str) -> None:
    k, groups = world(2)

    def body(g):
        k.sleep(2.0 * g.rank())
        if case == "shape":
            torch_dist.all_reduce(torch.ones(2 + g.rank()), group=g)
        elif case == "dtype":
            torch_dist.all_reduce(torch.ones(2, dtype=torch.float32 if g.rank() else torch.float64), group=g)
        elif case == "list_length":
            torch_dist.broadcast_object_list([1] * (1 + g.rank()), group_src=0, group=g)
        else:
            torch_dist.broadcast_object_list([1], group_src=g.rank(), group=g)
        return "returned"

    got = _spawn_all(k, groups, body)
    assert [kind for kind, *_ in got] == [
        "RuntimeError",
        "RuntimeError" if case in ("shape", "dtype") else "CollectiveMismatch",
    ]
    assert got[0][2] == got[1][2] == 2.0, got  # when the last member arrived, not after a timeout
    assert "connection closed by peer (rank 1" in got[0][1]
    # gloo closes the connections: the group is unusable afterwards
    assert groups[0].rendezvous.broken is not None


def test_after_a_timeout_the_group_is_closed_and_a_late_arrival_fails_at_once() -> None:
    k, groups = world(2, timeout=10.0)

    def body(g):
        if g.rank() == 1:
            k.sleep(15.0)  # arrives after rank 0 gave up
        torch_dist.barrier(group=g)
        return "ok"

    got = _spawn_all(k, groups, body)
    assert got[0] == (
        "CollectiveTimeout",
        "barrier #0 on group eplb#0 timed out after 10 s: ranks [1] (pids [11]) never arrived",
        10.0,
    )
    assert got[1][0] == "RuntimeError" and got[1][2] == 15.0 and "connection closed by peer" in got[1][1]


def test_work_wait_timeout_raises_and_leaves_the_collective_and_the_group_as_they_were() -> None:
    """As gloo (checked on torch 2.13): "Operation timed out!" when the wait's own bound passes; the collective
    completes when the last member arrives, a later wait() returns with the result, and the group works on."""
    import datetime

    k, groups = world(2)

    def body(g):
        if g.rank() == 1:
            k.sleep(100.0)
        t = torch.full((1,), float(g.rank() + 1))
        work = torch_dist.all_reduce(t, group=g, async_op=True)
        seen = []
        try:
            work.wait(timeout=datetime.timedelta(seconds=5))
        except CollectiveTimeout as exc:
            seen.append((str(exc), k.now(), work.is_completed()))
        work.wait()
        after = torch.ones(1)
        torch_dist.all_reduce(after, group=g)
        return seen, t.item(), k.now(), after.item()

    got = _spawn_all(k, groups, body)
    assert got[0] == (
        "ok",
        (
            [
                (
                    "Operation timed out! (all_reduce[SUM] #0 on group eplb#0: ranks [1] (pids [11]) had "
                    "not arrived after Work.wait's 5 s)",
                    5.0,
                    False,
                )
            ],
            3.0,
            100.0,
            2.0,
        ),
    )
    assert got[1] == ("ok", ([], 3.0, 100.0, 2.0))
    assert groups[0].rendezvous.broken is None


def test_a_zero_wait_timeout_is_no_bound() -> None:
    import datetime

    k, groups = world(2)

    def body(g):
        if g.rank() == 1:
            k.sleep(2.0)
        torch_dist.barrier(group=g, async_op=True).wait(timeout=datetime.timedelta(0))
        return k.now()

    assert _spawn_all(k, groups, body) == [("ok", 2.0)] * 2


def test_async_all_reduce_is_issued_at_the_call_and_completes_without_wait() -> None:
    k, groups = world(2)

    def body(g):
        t = torch.full((2,), float(g.rank() + 1))
        work = torch_dist.all_reduce(t, group=g, async_op=True)
        torch_dist.barrier(group=g)  # the next collective before waiting: fine, the first was issued already
        k.sleep(1.0)
        completed, value = work.is_completed(), t.tolist()
        work.wait()
        return completed, value, work.is_success()

    assert _spawn_all(k, groups, body) == [("ok", (True, [3.0, 3.0], True))] * 2


def test_reduce_ops_follow_gloo_on_dtypes() -> None:
    k, groups = world(2)

    def body(g):
        out = {}
        for op in ("BAND", "BOR", "BXOR"):
            t = torch.tensor([1, 2, 3]) * (g.rank() + 1)
            torch_dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g)
            out[op] = t.tolist()
        with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired output type Long"):
            torch_dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG, group=g)
        with pytest.raises(RuntimeError, match="Cannot use ReduceOp.BAND with non-integral dtype"):
            torch_dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND, group=g)
        with pytest.raises(TypeError):
            torch_dist.all_reduce(torch.ones(2), op="max", group=g)
        avg = torch.tensor([1.0, 4.0]) * (g.rank() + 1)
        torch_dist.all_reduce(avg, op=dist.ReduceOp.AVG, group=g)  # refused calls issued nothing
        out["AVG"] = avg.tolist()
        return out

    expected = {"BAND": [0, 0, 2], "BOR": [3, 6, 7], "BXOR": [3, 6, 5], "AVG": [1.5, 6.0]}
    assert _spawn_all(k, groups, body) == [("ok", expected)] * 2


def test_all_gather_object_fills_the_callers_list_as_torch_does() -> None:
    k, groups = world(2)

    def body(g):
        if g.rank() == 0:
            longer = ["a", "b", "kept"]
            torch_dist.all_gather_object(longer, g.rank(), group=g)
            return longer
        torch_dist.all_gather_object([None], g.rank(), group=g)  # one slot short: torch raises after the gather

    got = _spawn_all(k, groups, body)
    assert got[0] == ("ok", [0, 1, "kept"])
    assert got[1][0] == "IndexError"


def test_an_object_that_does_not_pickle_is_refused_before_the_collective_is_issued() -> None:
    k, groups = world(2)

    def body(g):
        if g.rank() == 0:
            with pytest.raises((AttributeError, pickle.PicklingError)):
                torch_dist.all_gather_object([None, None], lambda: 0, group=g)
        out = [None, None]
        torch_dist.all_gather_object(out, g.rank(), group=g)  # the retry meets the other rank's first call
        return out

    assert _spawn_all(k, groups, body) == [("ok", [0, 1])] * 2


def test_a_process_using_another_members_handle_is_refused() -> None:
    # Processes share no objects; taking rank 0's place would make the real rank 0 time out, naming nobody.
    k, groups = world(2)
    got = {}

    def intruder():
        try:
            torch_dist.barrier(group=groups[0])
        except RuntimeError as exc:
            got["error"] = str(exc)

    k.spawn("intruder", intruder, pid=7)
    k.run()
    assert got == {"error": "barrier on group eplb#0: pid 7 used the handle of rank 0 (pid 10)"}


def test_the_result_lands_once_and_never_over_what_the_caller_wrote_since() -> None:
    k, groups = world(2)

    def body(g):
        k.sleep(float(g.rank()))  # rank 1 arrives last: its collective is complete at once
        t = torch.tensor([float(g.rank() + 1)])
        torch_dist.all_reduce(t, group=g)
        t.add_(100)
        k.sleep(0.0)  # the completion is processed here
        return t.item()

    assert _spawn_all(k, groups, body) == [("ok", 103.0)] * 2


def test_a_wait_bound_holds_while_only_the_latency_is_left() -> None:
    import datetime

    k = Kernel(seed=0)
    groups = Rendezvous(k, "eplb#0", [10, 11], 300.0, latency_s=5.0).groups()

    def body(g):
        work = torch_dist.barrier(group=g, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=1))
        except CollectiveTimeout as exc:
            return str(exc), k.now(), work.is_completed()
        return "no timeout"

    got = _spawn_all(k, groups, body)
    assert (
        got
        == [
            (
                "ok",
                (
                    "Operation timed out! (barrier #0 on group eplb#0: the result had not landed after "
                    "Work.wait's 1 s)",
                    1.0,
                    False,
                ),
            )
        ]
        * 2
    )


def test_a_group_timeout_closes_the_group_and_ends_the_other_members_waits_at_once() -> None:
    # Rank 1 waits on its second collective (issued before the first is waited for); rank 0 times out on the
    # first, whose deadline passes: gloo closes the pairs, and rank 1's wait on the second ends then too.
    k, groups = world(3, timeout=5.0)

    def body(g):
        if g.rank() == 2:
            k.sleep(20.0)
            torch_dist.barrier(group=g)
        elif g.rank() == 1:
            k.sleep(1.0)
            first = torch_dist.barrier(group=g, async_op=True)
            torch_dist.barrier(group=g, async_op=True).wait()
            first.wait()
        else:
            torch_dist.barrier(group=g)
        return "ok"

    got = _spawn_all(k, groups, body)
    assert got[0][0] == "CollectiveTimeout" and got[0][2] == 5.0
    # ended when the first timed out, not at its own deadline (6 s)
    assert got[1][0] == "RuntimeError" and got[1][2] == 5.0 and "connection closed by peer" in got[1][1]
    assert got[2][0] == "RuntimeError" and got[2][2] == 20.0 and "connection closed by peer" in got[2][1]


def _kill_at(k, pid: int, at: float) -> None:
    """Process ``pid`` killed at ``at`` simulated seconds, as the cluster ends a rank's process."""

    def killer():
        k.sleep(at)
        k.kill_process(pid)
        torch_dist.process_gone(k, pid, "was killed")

    k.spawn("killer", killer, pid=99)


@pytest.mark.parametrize("when", ["while they wait", "before they arrive"])
def test_a_member_s_death_fails_the_others_collectives_at_once(when: str) -> None:
    """As gloo (checked on torch 2.13 with a SIGKILLed member): every other member's collective on the group, in
    flight or later, fails within milliseconds with "Connection closed by peer", not at the group's timeout."""
    k, groups = world(3)
    late = when == "before they arrive"

    def body(g):
        if g.rank() == 2:
            k.sleep(1000.0)  # killed at 1 s
        if late:
            k.sleep(2.0)
        errors = []
        for call in (lambda: torch_dist.all_reduce(torch.ones(1), group=g), lambda: torch_dist.barrier(group=g)):
            try:
                call()
            except CollectiveTimeout as exc:  # ConnectionClosed: a liveness failure, as the real judge calls it
                errors.append((type(exc).__name__, str(exc), exc.missing, k.now()))
        return errors

    _kill_at(k, 12, 1.0)
    got = _spawn_all(k, groups, body)
    t, seq = (2.0, "") if late else (1.0, " #0")  # a call on a closed group fails before it has a number
    for rank in (0, 1):
        assert got[rank] == (
            "ok",
            [
                (
                    "ConnectionClosed",
                    f"all_reduce[SUM]{seq} on group eplb#0: connection closed by peer (pid 12 was killed)",
                    [2],
                    t,
                ),
                ("ConnectionClosed", "barrier on group eplb#0: connection closed by peer (pid 12 was killed)", [2], t),
            ],
        )


def test_a_destroyed_group_is_not_closed_by_a_member_s_exit_and_other_groups_are() -> None:
    k = Kernel(seed=0)
    old, new, other = (
        Rendezvous(k, name, pids) for name, pids in (("eplb#0", [10, 11]), ("eplb#1", [10, 11]), ("eplb#2", [10, 12]))
    )
    old.destroyed = True
    torch_dist.process_gone(k, 11)
    assert (old.broken, new.broken, other.broken) == (None, "pid 11 exited", None)


@pytest.mark.parametrize("seed", range(6))
def test_a_wait_bound_that_ends_with_the_deadline_is_the_deadline_whatever_the_seed(seed: int) -> None:
    # A bound ending at the collective's deadline must not race it in the tie-break, where the seed would choose
    # between "Operation timed out!" (group left open) and the group's timeout (group closed).
    import datetime

    k = Kernel(seed=seed)
    groups = Rendezvous(k, "eplb#0", [10, 11], 300.0).groups()

    def body(g):
        if g.rank() == 1:
            return "absent"
        work = torch_dist.barrier(group=g, async_op=True)
        k.sleep(100.0)
        work.wait(timeout=datetime.timedelta(seconds=200))

    got = _spawn_all(k, groups, body)
    assert got[0] == (
        "CollectiveTimeout",
        "barrier #0 on group eplb#0 timed out after 300 s: ranks [1] (pids [11]) never arrived",
        300.0,
    )
    assert groups[0].rendezvous.broken == "collective #0 timed out on rank 0"


def test_a_collective_in_flight_when_a_member_died_fails_as_closed_even_when_waited_after_its_deadline() -> None:
    k, groups = world(3)

    def body(g):
        if g.rank() == 2:
            k.sleep(1000.0)
        work = torch_dist.all_reduce(torch.ones(1), group=g, async_op=True)
        k.sleep(400.0)  # past the collective's 300 s deadline
        work.wait()

    _kill_at(k, 12, 1.0)
    got = _spawn_all(k, groups, body)
    assert (
        got[0]
        == got[1]
        == (
            "ConnectionClosed",
            "all_reduce[SUM] #0 on group eplb#0: connection closed by peer (pid 12 was killed)",
            400.0,
        )
    )
    assert not [f for _, kind, f in k.history.records if kind == "collective.timeout"]


@pytest.mark.parametrize("seconds, outcome", [(0.0004, ("ok", 2.0)), (-1.0, "timed out at 0 s")])
def test_wait_bounds_are_whole_milliseconds_as_torch_hands_them_to_gloo(seconds: float, outcome) -> None:
    import datetime

    k, groups = world(2)

    def body(g):
        if g.rank() == 1:
            k.sleep(2.0)
            torch_dist.barrier(group=g)
            return k.now()
        work = torch_dist.barrier(group=g, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=seconds))  # under 1 ms is 0 ms: no bound
        except CollectiveTimeout as exc:
            assert str(exc).startswith("Operation timed out!")
            return f"timed out at {k.now():g} s"
        return k.now()

    assert _spawn_all(k, groups, body)[0] == (outcome if isinstance(outcome, tuple) else ("ok", outcome))
