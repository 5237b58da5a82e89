"""The rebalance policy: vLLM's default policy in literal placements (global and hierarchical), determinism, every
expert present, replicas of a group kept on its node, a better balance than the initial map when one hot expert sits
in a single slot, and experts a rank keeps staying in their slots (vLLM's preserve_intragpu_slots)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collections import Counter

from sim.eplb import move
from sim.eplb.policy import (
    balanced_packing,
    balancedness,
    node_layout,
    preserve_slots,
    rank_loads,
    rebalance,
    replicate,
)
from sim.eplb.state import EplbError
from sim.eplb.state import ModelShape, Placement

SHAPE = ModelShape(num_layers=2, num_logical_experts=4, num_local_experts=3)


def test_literal_rebalance_two_ranks() -> None:
    load = np.array([[10, 1, 1, 8], [0, 0, 0, 0]])
    p = rebalance(load, SHAPE, 2)
    # layer 0: 0 and 3 are hot and get a second replica each (physical 4 and 5); per replica 5 5 4 4 1 1, heaviest
    # first into the lighter rank (ties: rank 0): slot order is the order a rank got them.
    # layer 1: no load: argmax of 0/count is expert 0 every time, and the packing fills rank 0 first.
    assert p.to_list() == [[0, 3, 1, 0, 3, 2], [0, 1, 2, 3, 0, 0]]
    assert rank_loads(load, p).tolist() == [[10.0, 10.0], [0.0, 0.0]]
    assert balancedness(load, p) == 1.0
    initial = Placement.initial(SHAPE, 2)  # rank 0: 0 1 2 (5+0.5+1), rank 1: 3 0 1 (8+5+0.5)
    assert rank_loads(load, initial)[0].tolist() == [6.5, 13.5]
    assert balancedness(load, initial) == pytest.approx(10 / 13.5)


def replica_counts(loads, num_physical: int) -> list[int]:
    """How many slots each expert of one layer gets under the global rule."""
    return replicate([float(x) for x in loads], num_physical)[1]


def test_replica_counts() -> None:
    assert replica_counts([10, 1, 1, 8], 6) == [2, 1, 1, 2]
    assert replicate([10.0, 1.0, 1.0, 8.0], 6)[0] == [0, 1, 2, 3, 0, 3]  # identity, then each pick in turn
    assert replica_counts([9, 1], 5) == [4, 1]  # 9/4 = 2.25 > 1: no cap at the rank count
    assert replica_counts([6, 3], 4) == [3, 1]  # 6/2 == 3/1: a tie goes to the lower id
    assert replica_counts([3, 3], 3) == [2, 1]
    assert replica_counts([0, 0, 0], 7) == [5, 1, 1]  # argmax of all zeros is expert 0 every time


def test_balanced_packing() -> None:
    assert balanced_packing([4, 3, 2, 1], 2) == [[0, 3], [1, 2]]
    assert balanced_packing([1, 5, 5], 3) == [[0], [1], [2]]  # one item per pack: in order, no sorting
    assert balanced_packing([1, 5, 5, 2], 1) == [[1, 2, 3, 0]]
    with pytest.raises(ValueError, match="split evenly"):
        balanced_packing([1, 2, 3], 2)


def test_node_layout() -> None:
    assert node_layout(8, 8, 64) == (8, 8)  # DeepSeek-V3 at EP64 on 8-GPU nodes: hierarchical
    assert node_layout(8, 9, 72) == (1, 1)  # 8 groups do not split over 9 nodes: global
    assert node_layout(8, 9, 68) == (8, 1)  # 68 ranks do not split over 9 nodes: one node, groups kept
    assert node_layout(1, 2, 16) == (1, 1)


def test_hierarchical_literal() -> None:
    """Groups {0, 1} and {2, 3} on two nodes of one rank each: as many groups as nodes, so group g goes to node g
    (vLLM packs one item per pack in order), and each node replicates and packs only its own experts."""
    load = np.array([[1, 2, 10, 3]])
    shape = ModelShape(num_layers=1, num_logical_experts=4, num_local_experts=2, num_expert_groups=2)
    assert rebalance(load, shape, 2, num_nodes=2).to_list() == [[1, 0, 2, 3]]  # heaviest first within a rank
    # A third slot per rank: node 0 replicates 1 (2 > 1), node 1 replicates 2; neither replica leaves its node.
    shape3 = ModelShape(num_layers=1, num_logical_experts=4, num_local_experts=3, num_expert_groups=2)
    assert rebalance(load, shape3, 2, num_nodes=2).to_list() == [[0, 1, 1, 2, 2, 3]]
    # One node: the groups are ordered by load ({2, 3} first), then the global rule: expert 2 gets two more
    # replicas, two of its three land on rank 0, as vLLM's packing allows.
    assert rebalance(load, shape3, 2, num_nodes=1).to_list() == [[2, 2, 0, 2, 3, 1]]
    # Without groups the same load on two nodes is global too (one group does not split over two nodes).
    flat = ModelShape(num_layers=1, num_logical_experts=4, num_local_experts=3)
    assert rebalance(load, flat, 2, num_nodes=2) == rebalance(load, flat, 2, num_nodes=1)


def test_one_rank_holds_everything() -> None:
    shape = ModelShape(1, 3, 5)
    p = rebalance(np.array([[1, 50, 2]]), shape, 1)
    assert p.to_list() == [[1, 1, 1, 2, 0]]  # heaviest per replica first


@pytest.mark.parametrize(
    "load, message",
    [
        (np.zeros((2, 3)), "shape"),
        (np.array([[1, 2, 3, -4]] * 2), "negative"),
        (np.array([[1, 2, 3, np.inf]] * 2), "finite"),
    ],
)
def test_bad_load(load, message) -> None:
    with pytest.raises(ValueError, match=message):
        rebalance(load, SHAPE, 2)


def test_too_few_slots() -> None:
    with pytest.raises(ValueError, match="num_logical_experts=4"):
        rebalance(np.zeros((2, 4)), SHAPE, 1)


def test_balancedness_without_load_is_one() -> None:
    assert balancedness(np.zeros((2, 4)), Placement.initial(SHAPE, 2)) == 1.0


@st.composite
def cases(draw):
    num_layers = draw(st.integers(1, 2))
    num_logical = draw(st.integers(1, 10))
    num_local = draw(st.integers(1, 5))
    min_ep = -(-num_logical // num_local)
    ep_size = draw(st.integers(min_ep, min_ep + 3))
    shape = ModelShape(num_layers, num_logical, num_local)
    load = np.array(
        draw(
            st.lists(
                st.lists(st.integers(0, 1000), min_size=num_logical, max_size=num_logical),
                min_size=num_layers,
                max_size=num_layers,
            )
        ),
        dtype=np.int64,
    )
    return shape, ep_size, load


@settings(max_examples=80, deadline=None)
@given(cases())
def test_policy_properties(case) -> None:
    shape, ep_size, load = case
    p = rebalance(load, shape, ep_size)
    assert p == rebalance(load.copy(), shape, ep_size)  # deterministic
    assert p.ep_size == ep_size and p.num_local_experts == shape.num_local_experts
    for layer in range(shape.num_layers):
        counts = p.logical_replica_count(layer)
        assert counts.min() >= 1  # every logical expert present
        assert counts.tolist() == replica_counts(load[layer], shape.num_physical(ep_size))
    assert 0.0 < balancedness(load, p) <= 1.0


@st.composite
def grouped_cases(draw):
    num_nodes = draw(st.integers(1, 4))
    groups = num_nodes * draw(st.integers(1, 3))
    group_size = draw(st.integers(1, 3))
    num_logical = groups * group_size
    ranks_per_node = draw(st.integers(1, 3))
    ep_size = num_nodes * ranks_per_node
    num_local = draw(st.integers(-(-num_logical // ep_size), -(-num_logical // ep_size) + 2))
    shape = ModelShape(1, num_logical, num_local, num_expert_groups=groups)
    load = np.array([draw(st.lists(st.integers(0, 1000), min_size=num_logical, max_size=num_logical))])
    return shape, ep_size, num_nodes, load


@settings(max_examples=80, deadline=None)
@given(grouped_cases())
def test_hierarchical_keeps_groups_on_their_node(case) -> None:
    """Every expert of a group, and every replica of it, sits on one node; each node holds whole groups, as many
    as any other node; and each node's replica counts follow the greedy rule over its own experts: every extra
    replica went to an expert at least as loaded per replica as any expert ends up."""
    shape, ep_size, num_nodes, load = case
    p = rebalance(load, shape, ep_size, num_nodes=num_nodes)
    assert p == rebalance(load.copy(), shape, ep_size, num_nodes=num_nodes)
    per_node = ep_size // num_nodes * shape.num_local_experts
    group_size = shape.num_logical_experts // shape.num_expert_groups
    rows = p.physical_to_logical[0].tolist()
    node_of: dict[int, set[int]] = {}
    for slot, e in enumerate(rows):
        node_of.setdefault(e // group_size, set()).add(slot // per_node)
    assert all(len(nodes) == 1 for nodes in node_of.values()), node_of
    assert len(node_of) == shape.num_expert_groups  # every group (so every expert's group) is placed
    for node in range(num_nodes):
        held = rows[node * per_node : (node + 1) * per_node]
        experts = sorted(set(held))
        assert len(experts) == shape.num_logical_experts // num_nodes  # whole groups, equal shares
        counts = {e: held.count(e) for e in experts}
        final = max(load[0][e] / counts[e] for e in experts)
        assert all(load[0][e] / (counts[e] - 1) >= final for e in experts if counts[e] > 1), counts


@st.composite
def one_hot_cases(draw):
    """Skewed load: one hot expert that the initial map gives a single slot (its id is past the round-robin
    redundant copies), every other expert nearly idle."""
    num_layers = draw(st.integers(1, 2))
    num_local = draw(st.integers(1, 5))
    num_logical = draw(st.integers(num_local + 1, 12))
    min_ep = max(2, -(-num_logical // num_local))
    ep_size = draw(st.integers(min_ep, min_ep + 3))
    shape = ModelShape(num_layers, num_logical, num_local)
    redundant = shape.num_redundant(ep_size)
    if redundant >= num_logical:
        ep_size = min_ep
        redundant = shape.num_redundant(ep_size)
    load = np.zeros((num_layers, num_logical), dtype=np.int64)
    for layer in range(num_layers):
        load[layer] = draw(st.lists(st.integers(0, 9), min_size=num_logical, max_size=num_logical))
        if redundant < num_logical:
            hot = draw(st.integers(redundant, num_logical - 1))
            load[layer, hot] = draw(st.integers(100, 1000))
    return shape, ep_size, load


@settings(max_examples=80, deadline=None)
@given(one_hot_cases())
def test_policy_beats_initial_on_skewed_load(case) -> None:
    shape, ep_size, load = case
    before = balancedness(load, Placement.initial(shape, ep_size))
    after = balancedness(load, rebalance(load, shape, ep_size))
    assert after >= before - 1e-12, (before, after)


def test_policy_beats_initial_on_literal_zipf() -> None:
    shape = ModelShape(num_layers=1, num_logical_experts=16, num_local_experts=5)
    load = (10_000 * (np.arange(16) + 1.0) ** -1.2).astype(np.int64)[None]  # hottest experts share rank 0
    before = balancedness(load, Placement.initial(shape, 4))
    after = balancedness(load, rebalance(load, shape, 4))
    assert before < 0.65 and after > 0.99


def test_preserve_slots_literal() -> None:
    # 3 and 0 stay on the rank: they keep slots 0 and 2; the newcomer 2 takes the slot 1 left free.
    assert preserve_slots([0, 2, 3], [3, 1, 0]) == [3, 2, 0]
    # two replicas of 5 on the rank before and after: each old slot of 5 keeps one; 7 fills the gap.
    assert preserve_slots([5, 5, 7], [5, 9, 5]) == [5, 7, 5]
    # one replica of 5 kept out of two: the first old slot of 5 keeps it.
    assert preserve_slots([1, 5, 7], [5, 9, 5]) == [5, 1, 7]
    # a rank that held nothing (it joins in a scale-up): the new order as it is.
    assert preserve_slots([4, 1], [-1, -1]) == [4, 1]
    assert preserve_slots([4, 1], [4, 1]) == [4, 1]


def _kept(old_rows, new_rows) -> int:
    return sum((Counter(old_rows) & Counter(new_rows)).values())


@st.composite
def preserve_cases(draw):
    shape, ep_size, load = draw(cases())
    old_ep = draw(st.integers(-(-shape.num_logical_experts // shape.num_local_experts), ep_size + 2))
    old_load = np.array(
        draw(
            st.lists(
                st.lists(st.integers(0, 1000), min_size=shape.num_logical_experts, max_size=shape.num_logical_experts),
                min_size=shape.num_layers,
                max_size=shape.num_layers,
            )
        ),
        dtype=np.int64,
    )
    return shape, ep_size, load, rebalance(old_load, shape, old_ep)


@settings(max_examples=80, deadline=None)
@given(preserve_cases())
def test_kept_experts_keep_their_slots(case) -> None:
    """Given the placement it replaces (of any size: the group may grow or shrink), every rank in both holds the
    same experts as without it, and as many rows as possible are left alone: no local copy is left for the move
    planner except a replica the rank did not hold as often before."""
    shape, ep_size, load, previous = case
    plain = rebalance(load, shape, ep_size)
    p = rebalance(load, shape, ep_size, previous=previous)
    assert p == rebalance(load.copy(), shape, ep_size, previous=previous)
    for layer in range(shape.num_layers):
        for rank in range(ep_size):
            new, base = p.local(rank, layer), plain.local(rank, layer)
            assert sorted(new) == sorted(base)
            if rank >= previous.ep_size:
                assert new == base
                continue
            old = previous.local(rank, layer)
            assert sum(a == b for a, b in zip(old, new)) == _kept(old, new)
    if previous.ep_size == ep_size:
        for layer in range(shape.num_layers):
            for plan in move.plan_all(previous, p, layer):
                assert all(
                    plan.old_rows.count(plan.new_rows[dst]) < plan.new_rows.count(plan.new_rows[dst])
                    for dst, _ in plan.local_copies
                )


def test_previous_placement_with_other_slots_per_rank_is_refused() -> None:
    other = ModelShape(num_layers=2, num_logical_experts=4, num_local_experts=2)
    with pytest.raises(EplbError, match="2 slots per rank"):
        rebalance(np.ones((2, 4)), SHAPE, 2, previous=Placement.initial(other, 2))
