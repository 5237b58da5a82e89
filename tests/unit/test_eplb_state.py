"""EPLB state: ModelShape validation, Placement queries and elastic resize, the load window, signature weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.errors import EpsimError
from sim.eplb.state import (
    EplbError,
    LoadWindow,
    ModelShape,
    Placement,
    check_weights,
    fill_weights,
    normalize_rank_mapping,
    signature,
)

SHAPE = ModelShape(num_layers=2, num_logical_experts=4, num_local_experts=3)


def zero_weights(shape: ModelShape, tensors: int = 2) -> list[list[torch.Tensor]]:
    return [
        [torch.zeros(shape.num_local_experts, shape.hidden) for _ in range(tensors)] for _ in range(shape.num_layers)
    ]


# ------------------------------------------------------------------------------------------------------ ModelShape


def test_model_shape_physical_counts() -> None:
    assert SHAPE.hidden == 4
    assert SHAPE.num_physical(2) == 6
    assert SHAPE.num_redundant(2) == 2
    SHAPE.validate(2)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_layers=0, num_logical_experts=4, num_local_experts=3), "num_layers"),
        (dict(num_layers=1, num_logical_experts=0, num_local_experts=3), "num_logical_experts"),
        (dict(num_layers=1, num_logical_experts=4, num_local_experts=0), "num_local_experts"),
        (dict(num_layers=1, num_logical_experts=4, num_local_experts=3, hidden=0), "hidden"),
        (dict(num_layers=True, num_logical_experts=4, num_local_experts=3), "num_layers"),
        (dict(num_layers=1.0, num_logical_experts=4, num_local_experts=3), "num_layers"),
    ],
)
def test_model_shape_rejects_bad_fields(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field) as info:
        ModelShape(**kwargs)
    assert "\n" not in str(info.value)


def test_model_shape_too_few_slots_names_the_fields() -> None:
    with pytest.raises(ValueError) as info:
        SHAPE.validate(1)
    message = str(info.value)
    assert "num_local_experts=3" in message and "num_logical_experts=4" in message and "ep_size=1" in message
    assert "\n" not in message
    assert isinstance(info.value, EpsimError)
    with pytest.raises(ValueError, match="ep_size"):
        SHAPE.validate(0)
    with pytest.raises(ValueError, match="num_logical_experts"):
        Placement.initial(SHAPE, 1)


# ------------------------------------------------------------------------------------------------------- Placement


def test_initial_placement_literal() -> None:
    p = Placement.initial(SHAPE, 2)
    assert p.to_list() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]]
    assert (p.ep_size, p.num_layers, p.num_physical, p.num_local_experts, p.num_logical) == (2, 2, 6, 3, 4)
    assert p.local(0, 0) == [0, 1, 2]
    assert p.local(1, 1) == [3, 0, 1]
    assert p.ranks_holding(0, 0) == [0, 1]
    assert p.ranks_holding(0, 3) == [1]
    assert p.row_of(1, 0, 0) == 1
    assert p.row_of(0, 0, 3) == -1
    assert p.logical_to_physical(0).tolist() == [[0, 4], [1, 5], [2, -1], [3, -1]]
    assert p.logical_replica_count(1).tolist() == [2, 2, 1, 1]


def test_placement_duplicates_on_one_rank() -> None:
    p = Placement([[0, 0, 1, 1]], ep_size=2)
    assert p.local(0, 0) == [0, 0]
    assert p.row_of(0, 0, 0) == 0
    assert p.ranks_holding(0, 1) == [1]
    assert p.logical_to_physical(0).tolist() == [[0, 1], [2, 3]]


def test_placement_is_read_only_and_copies_its_input() -> None:
    src = np.array([[0, 1, 2, 3]])
    p = Placement(src, ep_size=2)
    src[0, 0] = 3
    assert p.to_list() == [[0, 1, 2, 3]]
    with pytest.raises(ValueError):
        p.physical_to_logical[0, 0] = 1


def test_placement_value_semantics() -> None:
    a = Placement.initial(SHAPE, 2)
    b = Placement.from_list(a.to_list(), 2, 4)
    assert a == b and hash(a) == hash(b)
    assert a != Placement.initial(SHAPE, 3)
    assert a != Placement.from_list(a.to_list(), 2, 4).resized(2, {0: 1, 1: 0})
    assert a != "not a placement"
    assert len({a, b}) == 1
    assert "ep_size=2" in repr(a)


def test_placement_digest_follows_every_slot() -> None:
    a = Placement.from_list([[0, 1, 2, 3], [3, 2, 1, 0]], 2, 4)
    assert a.digest() == Placement.from_list(a.to_list(), 2, 4).digest()
    assert len(a.digest()) == 16 and int(a.digest(), 16) >= 0
    # a reorder within rank 0 of layer 1 moves no bytes between ranks; the digest still changes
    others = [
        Placement.from_list([[0, 1, 2, 3], [2, 3, 1, 0]], 2, 4),
        Placement.from_list([[0, 1, 2, 3], [3, 2, 1, 0]], 4, 4),  # the same slots over four ranks
        Placement.from_list([[0, 1, 3, 2], [3, 2, 1, 0]], 2, 4),
    ]
    assert len({a.digest(), *(o.digest() for o in others)}) == 4


@pytest.mark.parametrize(
    "p2l, ep_size, num_logical, message",
    [
        ([[0, 1, 2]], 2, None, "not a multiple of ep_size=2"),
        ([0, 1], 1, None, "shape"),
        ([[0, 1, 1, 3]], 2, None, r"no slot for logical experts \[2\]"),
        ([[0, 1, 2, 4]], 2, 4, "outside 0..3"),
        ([[0, -1, 2, 3]], 2, None, "outside"),
        ([[0, 1, 2, 3]], 0, None, "ep_size"),
        ([[0.0, 1.5, 2.0, 3.0]], 2, None, "integer logical ids"),
        ([[]], 1, None, "non-empty"),
    ],
)
def test_placement_rejects_bad_maps(p2l, ep_size, num_logical, message) -> None:
    with pytest.raises(ValueError, match=message):
        Placement(p2l, ep_size, num_logical)


def test_placement_index_errors() -> None:
    p = Placement.initial(SHAPE, 2)
    with pytest.raises(IndexError, match="rank 2"):
        p.local(2, 0)
    with pytest.raises(IndexError, match="layer 2"):
        p.ranks_holding(2, 0)


# ------------------------------------------------------------------------------------------------- elastic resize


def test_resize_scale_up_fills_new_rank_with_least_replicated() -> None:
    p = Placement.initial(SHAPE, 2)
    up = p.resized(3)
    # counts before: 0:2 1:2 2:1 3:1 -> new rank 2 gets 2, 3, then 0 (all at 2, lowest id).
    assert up.to_list() == [[0, 1, 2, 3, 0, 1, 2, 3, 0]] * 2
    assert up.ep_size == 3 and up.num_local_experts == 3


def test_resize_with_explicit_mapping_moves_ranks() -> None:
    p = Placement([[0, 1, 2, 3]], ep_size=2)
    swapped = p.resized(3, {0: 2, 1: 0})
    assert swapped.local(0, 0) == [2, 3]
    assert swapped.local(2, 0) == [0, 1]
    assert swapped.local(1, 0) == [0, 1]  # fresh rank: all counts 1, lowest ids first


def test_resize_scale_down() -> None:
    shape = ModelShape(1, 4, 4)
    p = Placement.initial(shape, 2)  # [0 1 2 3 | 0 1 2 3]
    assert p.resized(1).to_list() == [[0, 1, 2, 3]]
    assert p.resized(1, {0: -1, 1: 0}).to_list() == [[0, 1, 2, 3]]
    assert p.resized(1, [-1, 0]).to_list() == [[0, 1, 2, 3]]


def test_resize_scale_down_losing_an_expert_is_an_error() -> None:
    p = Placement.initial(SHAPE, 2)  # rank 1 holds [3, 0, 1]: expert 2 only lives on rank 0
    with pytest.raises(ValueError, match=r"loses logical experts \[2\] of layer 0") as info:
        p.resized(1, {0: -1, 1: 0})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({0: 0, 1: 0}, "both to new rank 0"),
        ({0: 5}, "not a rank of the new ep_size"),
        ({7: 0}, "old rank 7"),
        ({0: -2}, ">= -1"),
    ],
)
def test_rank_mapping_errors(mapping, message) -> None:
    with pytest.raises(ValueError, match=message):
        normalize_rank_mapping(mapping, 2, 3)


def test_rank_mapping_defaults() -> None:
    assert normalize_rank_mapping(None, 3, 2) == {0: 0, 1: 1, 2: -1}
    assert normalize_rank_mapping(None, 2, 4) == {0: 0, 1: 1}
    assert normalize_rank_mapping({1: 0}, 2, 1) == {0: -1, 1: 0}


@st.composite
def placements(draw, max_layers=2, max_logical=6, max_local=4, max_ep=4):
    num_layers = draw(st.integers(1, max_layers))
    num_logical = draw(st.integers(1, max_logical))
    num_local = draw(st.integers(1, max_local))
    min_ep = -(-num_logical // num_local)
    ep_size = draw(st.integers(min_ep, min_ep + max_ep - 1))
    shape = ModelShape(num_layers, num_logical, num_local)
    rows = []
    for _ in range(num_layers):
        extra = draw(
            st.lists(
                st.integers(0, num_logical - 1),
                min_size=shape.num_redundant(ep_size),
                max_size=shape.num_redundant(ep_size),
            )
        )
        rows.append(draw(st.permutations(list(range(num_logical)) + extra)))
    return shape, Placement(rows, ep_size, num_logical)


@settings(max_examples=60, deadline=None)
@given(placements(), st.data())
def test_resize_keeps_survivors_and_every_expert(case, data) -> None:
    shape, p = case
    new_ep = data.draw(st.integers(1, p.ep_size + 3), label="new_ep")
    olds = data.draw(st.permutations(range(p.ep_size)), label="order")
    keep = data.draw(st.integers(0, min(p.ep_size, new_ep)), label="keep")
    targets = data.draw(st.permutations(range(new_ep)), label="targets")
    mapping = {r: -1 for r in range(p.ep_size)}
    for old, new in zip(olds[:keep], targets[:keep]):
        mapping[old] = new
    survivors = [r for r in range(p.ep_size) if mapping[r] >= 0]
    lost = any(
        set(range(shape.num_logical_experts)) - {e for r in survivors for e in p.local(r, layer)}
        for layer in range(p.num_layers)
    )
    if lost:
        with pytest.raises(EplbError, match="loses logical experts"):
            p.resized(new_ep, mapping)
        return
    q = p.resized(new_ep, mapping)
    assert q.ep_size == new_ep and q.num_local_experts == p.num_local_experts and q.num_logical == p.num_logical
    for layer in range(p.num_layers):
        assert sorted(set(q.physical_to_logical[layer].tolist())) == list(range(shape.num_logical_experts))
        for r in survivors:
            assert q.local(mapping[r], layer) == p.local(r, layer)
    assert q == p.resized(new_ep, mapping)  # deterministic


# ----------------------------------------------------------------------------------------------------- LoadWindow


def test_load_window_ring() -> None:
    w = LoadWindow(num_layers=1, num_logical=2, window=2)
    assert w.total().tolist() == [[0, 0]]
    w.record(np.array([[1, 2]]))
    w.record(np.array([[10, 20]]))
    assert w.total().tolist() == [[11, 22]]
    w.record(np.array([[100, 200]]))  # the first step falls out
    assert w.total().tolist() == [[110, 220]]
    assert w.num_recorded == 3
    w.reset()
    assert w.total().tolist() == [[0, 0]] and w.num_recorded == 0
    assert w.total().dtype == np.int64


@pytest.mark.parametrize(
    "loads, message",
    [
        (np.zeros((2, 2)), "shape"),
        (np.array([[1, -1]]), "negative"),
        (np.array([[0.5, 1.0]]), "whole token counts"),
        (np.array([["a", "b"]]), "numeric"),
    ],
)
def test_load_window_rejects_bad_loads(loads, message) -> None:
    with pytest.raises(ValueError, match=message):
        LoadWindow(1, 2, 3).record(loads)


def test_load_window_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="window"):
        LoadWindow(1, 2, 0)


# -------------------------------------------------------------------------------------------------------- weights


def test_signature() -> None:
    assert signature(0, 3) == 3.0
    assert signature(2, 5) == 2005.0


def test_fill_and_check_weights() -> None:
    p = Placement.initial(SHAPE, 2)
    weights = zero_weights(SHAPE)
    fill_weights(weights, p, 1)
    assert weights[1][0][0].tolist() == [1003.0] * 4  # layer 1, rank 1 row 0 = logical 3
    assert weights[1][1][0].tolist() == [1003.25] * 4  # tensor 1 adds 0.25
    assert check_weights(weights, p, 1) == []
    assert len(check_weights(weights, p, 0)) == 2 * 2 * 3  # every row of rank 0 is wrong
    weights[0][1][2][1] = 7.0
    problems = check_weights(weights, p, 1)
    assert problems == ["rank 1 layer 0 tensor 1 row 2: expected logical 1 (1.25), found 7 in 1 of 4 elements"]


def test_check_weights_names_what_was_found() -> None:
    p = Placement.initial(SHAPE, 2)
    weights = zero_weights(SHAPE)
    fill_weights(weights, p, 0)
    weights[1][0][0].fill_(signature(1, 2))
    assert check_weights(weights, p, 0) == [
        "rank 0 layer 1 tensor 0 row 0: expected logical 0 (1000), found 1002 (logical 2 of layer 1)"
    ]


def test_weight_shape_errors() -> None:
    p = Placement.initial(SHAPE, 2)
    with pytest.raises(ValueError, match="layers"):
        fill_weights(zero_weights(ModelShape(1, 4, 3)), p, 0)
    bad = zero_weights(ModelShape(2, 4, 2))
    with pytest.raises(ValueError, match=r"weights\[0\]\[0\]"):
        fill_weights(bad, p, 0)
    assert "shape" in check_weights(bad, p, 0)[0]
    assert check_weights(bad[:1], p, 0) == ["rank 0: weights has 1 layers, placement has 2"]


def test_load_window_in_chunks_keeps_the_newest_records_that_cover_the_window() -> None:
    w = LoadWindow(num_layers=1, num_logical=1, window=1000)
    for loads, steps in [(1, 600), (10, 600), (100, 300)]:
        w.record(np.array([[loads]]), steps)
    assert w.total().tolist() == [[111]]  # without the oldest, 900 steps do not cover 1000: all three stay
    w.record(np.array([[1000]]), 200)
    assert w.total().tolist() == [[1110]] and w.num_recorded == 1700
    w.record(np.array([[5]]), 1000)  # covers the window alone
    assert w.total().tolist() == [[5]]
    with pytest.raises(ValueError, match="steps"):
        w.record(np.array([[1]]), 0)
