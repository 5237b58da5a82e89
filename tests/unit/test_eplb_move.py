"""Weight-move planning: literal plans, the fewest-sends source rule, elastic rank spaces, sender/receiver agreement,
and whole moves on in-memory tensors that must leave every rank's weights right for the new placement."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.eplb.move import (
    LayerPlan,
    apply_layer,
    layer_indices,
    move_from_buffer,
    plan_all,
    plan_layer,
    plan_sources,
    rank_space,
    rearrange_in_memory,
    stage_local_copies,
    transfer_layer,
)
from sim.eplb.policy import rebalance
from sim.eplb.state import EplbError, ModelShape, Placement, check_weights, fill_weights

SHAPE = ModelShape(num_layers=2, num_logical_experts=4, num_local_experts=3)


def weights_for(shape: ModelShape, placement: Placement | None, rank: int, tensors: int = 2):
    w = [
        [torch.full((shape.num_local_experts, shape.hidden), -5.0) for _ in range(tensors)]
        for _ in range(shape.num_layers)
    ]
    if placement is not None:
        fill_weights(w, placement, rank)
    return w


# ------------------------------------------------------------------------------------------------- literal plans


def test_literal_plan_two_ranks() -> None:
    old = Placement.initial(SHAPE, 2)  # [0 1 2 | 3 0 1] in both layers
    new = Placement([[0, 1, 3, 0, 2, 3], [0, 1, 2, 0, 1, 3]], ep_size=2)

    assert plan_sources(old, new, 0) == {(0, 2): 1, (1, 1): 0}
    r0, r1 = plan_layer(old, new, 0, 0), plan_layer(old, new, 0, 1)
    assert r0 == LayerPlan(
        layer=0,
        rank=0,
        old_rows=[0, 1, 2],
        new_rows=[0, 1, 3],
        unchanged=[0, 1],
        local_copies=[],
        recvs=[(2, 1, 3)],
        recv_copies=[],
        sends=[(1, 2)],
    )
    assert r1 == LayerPlan(
        layer=0,
        rank=1,
        old_rows=[3, 0, 1],
        new_rows=[0, 2, 3],
        unchanged=[],
        local_copies=[(0, 1), (2, 0)],
        recvs=[(1, 0, 2)],
        recv_copies=[],
        sends=[(0, 3)],
    )
    assert r0.send_row(2) == 2 and r1.send_row(3) == 0 and r0.send_row(3) == -1

    # layer 1: rank 0 keeps everything, rank 1 permutes its rows locally: [3 0 1] -> [0 1 3]
    assert plan_sources(old, new, 1) == {}
    assert plan_layer(old, new, 1, 0).is_noop
    assert plan_layer(old, new, 1, 1).local_copies == [(0, 1), (1, 2), (2, 0)]
    assert plan_all(old, new, 1) == [plan_layer(old, new, 1, 0), plan_layer(old, new, 1, 1)]


def test_receivers_are_paired_with_holders_as_vllm_does() -> None:
    # One slot per rank.  Expert 0 is held by ranks 0 and 1 and wanted by ranks 2, 3 and 4: one receiver per holder
    # in rank order, the one left over to the first holder.  Expert 1 is held by ranks 2, 3 and 4 and wanted by
    # ranks 0 and 1: fewer receivers than holders, so the first holders serve them.
    old = Placement([[0, 0, 1, 1, 1]], ep_size=5)
    new = Placement([[1, 1, 0, 0, 0]], ep_size=5)
    assert plan_sources(old, new, 0) == {(0, 0): 2, (1, 0): 3, (2, 0): 0, (3, 0): 1, (4, 0): 0}
    plans = plan_all(old, new, 0)
    assert [p.sends for p in plans] == [[(2, 0), (4, 0)], [(3, 0)], [(0, 1)], [(1, 1)], []]
    assert [p.recvs for p in plans] == [[(0, 2, 1)], [(0, 3, 1)], [(0, 0, 0)], [(0, 1, 0)], [(0, 0, 0)]]


def test_one_recv_per_expert_then_recv_copies() -> None:
    old = Placement([[0, 1, 2, 0]], ep_size=2)
    new = Placement([[2, 2, 0, 1]], ep_size=2)
    plans = plan_all(old, new, 0)
    assert plans[0].recvs == [(0, 1, 2)] and plans[0].recv_copies == [(1, 0)]
    assert plans[1].local_copies == [(0, 1)] and plans[1].recvs == [(1, 0, 1)]
    assert plans[1].sends == [(0, 2)] and plans[0].sends == [(1, 1)]
    shape = ModelShape(1, 3, 2)
    weights = [weights_for(shape, old, r) for r in range(2)]
    rearrange_in_memory(old, new, weights)
    assert check_weights(weights[0], new, 0) == [] and check_weights(weights[1], new, 1) == []


def test_local_permutation_needs_the_temporary() -> None:
    shape = ModelShape(1, 3, 3)
    old, new = Placement([[0, 1, 2]], 1), Placement([[2, 0, 1]], 1)
    plan = plan_layer(old, new, 0, 0)
    assert plan.local_copies == [(0, 2), (1, 0), (2, 1)] and not plan.recvs

    naive = weights_for(shape, old, 0)
    for dst, src in plan.local_copies:  # in place, no temporary: overwrites a source before it is read
        for t in naive[0]:
            t[dst].copy_(t[src])
    assert check_weights(naive, new, 0)

    weights = weights_for(shape, old, 0)
    buffer = [torch.empty_like(t) for t in weights[0]]
    apply_layer(weights[0], buffer, plan)
    assert check_weights(weights, new, 0) == []


def test_stage_then_move_from_buffer_with_a_received_row() -> None:
    shape = ModelShape(1, 3, 2)
    old, new = Placement([[0, 1, 2, 0]], 2), Placement([[1, 2, 0, 1]], 2)
    plan = plan_layer(old, new, 0, 0)
    assert plan.local_copies == [(0, 1)] and plan.recvs == [(1, 1, 2)]
    weights = weights_for(shape, old, 0)
    buffer = [torch.zeros_like(t) for t in weights[0]]
    stage_local_copies(weights[0], buffer, plan)
    assert check_weights(weights, old, 0) == []  # staging does not touch the weights (peers may be reading)
    for t, b in enumerate(buffer):  # what the communicator's READ would land
        b[1].fill_(2 + t * 0.25)
    move_from_buffer(weights[0], buffer, plan)
    assert check_weights(weights, new, 0) == []


def test_a_layers_local_copies_are_issued_before_its_transfer_context_as_vllm_does() -> None:
    """vLLM 0.33.0's move_to_buffer stages the layer's local copies into the buffer, then calls
    set_transfer_context (whose ROCm branch synchronizes the stream, so it waits for them too), then the sends,
    recvs and execute."""
    shape = ModelShape(1, 3, 2)
    old, new = Placement([[0, 1, 2, 0]], 2), Placement([[1, 2, 0, 1]], 2)
    plan = plan_layer(old, new, 0, 0)
    weights = weights_for(shape, old, 0)
    buffer = [torch.zeros_like(t) for t in weights[0]]
    seen: list[str] = []

    class Stream:
        def submit(self, op, what: str) -> None:
            seen.append(what)
            op()

    class Comm:
        def set_transfer_context(self, old_indices, layer: int) -> None:
            seen.append("set_transfer_context")

        def add_send(self, tensors, dst: int, expert_id: int) -> None:
            seen.append("add_send")

        def add_recv(self, tensors, src: int, expert_id: int) -> None:
            seen.append("add_recv")

        def execute(self) -> None:
            seen.append("execute")

    transfer_layer(
        Comm(),
        0,
        layer_indices(old, new, 0)[0],
        weights[0],
        buffer,
        plan,
        lambda tensors, row: [t[row] for t in tensors],
        Stream(),
    )
    assert seen[:2] == ["stage layer 0", "set_transfer_context"] and seen[-1] == "execute"


# ------------------------------------------------------------------------------------------------ elastic moves


def test_scale_up_runs_on_the_new_group() -> None:
    old = Placement.initial(SHAPE, 2)
    new = rebalance(np.array([[10, 1, 1, 8], [1, 2, 3, 4]]), SHAPE, 3)
    space = rank_space(old, new)
    assert (space.group, space.to_old, space.to_new, space.size) == ("new", (0, 1, -1), (0, 1, 2), 3)
    old_idx, new_idx = layer_indices(old, new, 0)
    assert old_idx.tolist() == [0, 1, 2, 3, 0, 1, -1, -1, -1]
    assert new_idx.tolist() == new.physical_to_logical[0].tolist()
    for layer in range(2):
        fresh = plan_layer(old, new, layer, 2)
        assert fresh.old_rows == [-1, -1, -1] and fresh.sends == [] and fresh.local_copies == []
        assert len(fresh.recvs) + len(fresh.recv_copies) == 3
    weights = [weights_for(SHAPE, old, 0), weights_for(SHAPE, old, 1), weights_for(SHAPE, None, 2)]
    rearrange_in_memory(old, new, weights)
    assert [check_weights(weights[r], new, r) for r in range(3)] == [[], [], []]


def test_scale_down_runs_on_the_old_group() -> None:
    old = Placement.initial(SHAPE, 3)  # [0 1 2 | 3 0 1 | 2 3 0]
    new = Placement([[0, 1, 3, 2, 0, 1]] * 2, ep_size=2, num_logical=4)
    space = rank_space(old, new, {0: 0, 1: 1, 2: -1})
    assert (space.group, space.to_old, space.to_new) == ("old", (0, 1, 2), (0, 1, -1))
    assert rank_space(old, new) == space
    assert layer_indices(old, new, 0)[1].tolist() == [0, 1, 3, 2, 0, 1, -1, -1, -1]
    leaving = plan_layer(old, new, 0, 2, {0: 0, 1: 1, 2: -1})
    assert leaving.new_rows == [-1, -1, -1] and leaving.recvs == [] and leaving.local_copies == []
    # 2 (for rank 1) is on ranks 0 and 2, 3 (for rank 0) on ranks 1 and 2: nobody has sent yet, lower rank wins
    assert plan_sources(old, new, 0) == {(0, 2): 1, (1, 0): 0}
    assert leaving.sends == []
    weights = [weights_for(SHAPE, old, r) for r in range(3)]
    rearrange_in_memory(old, new, weights, {0: 0, 1: 1, 2: -1})
    assert check_weights(weights[0], new, 0) == [] and check_weights(weights[1], new, 1) == []
    assert check_weights(weights[2], old, 2) == []  # the leaving rank's weights are untouched


def test_scale_down_leaving_rank_sends_what_only_it_holds() -> None:
    shape = ModelShape(1, 4, 3)
    old = Placement([[0, 0, 1, 1, 1, 0, 2, 3, 3]], ep_size=3)
    new = Placement([[0, 1, 2, 0, 1, 3]], ep_size=2)
    mapping = {0: -1, 1: 0, 2: 1}  # rank 0 leaves, ranks 1 and 2 move down
    with pytest.raises(EplbError, match="both removes"):
        rank_space(old, new, {0: -1, 1: 0, 2: -1})
    space = rank_space(old, new, mapping)
    assert space.to_new == (-1, 0, 1)
    plans = plan_all(old, new, 0, mapping)
    assert plans[1].new_rows == [0, 1, 2] and plans[1].recvs == [(2, 2, 2)]
    assert plans[2].new_rows == [0, 1, 3] and plans[2].unchanged == [2] and plans[2].local_copies == []
    # Both from rank 0, the leaving one: vLLM pairs an expert's first receiver with its first holder.
    assert plans[2].recvs == [(0, 0, 0), (1, 0, 1)]
    assert plans[0].sends == [(2, 0), (2, 1)] and plans[0].recvs == []
    weights = [weights_for(shape, old, r) for r in range(3)]
    rearrange_in_memory(old, new, weights, mapping)
    assert check_weights(weights[1], new, 0) == [] and check_weights(weights[2], new, 1) == []


def test_rank_space_errors() -> None:
    old = Placement.initial(SHAPE, 2)
    with pytest.raises(EplbError, match="both removes ranks and adds"):
        rank_space(old, old, {0: 0, 1: -1})
    with pytest.raises(EplbError, match="num_local_experts"):
        rank_space(old, Placement.initial(ModelShape(2, 4, 2), 2))
    with pytest.raises(EplbError, match="num_logical"):
        rank_space(old, Placement.initial(ModelShape(2, 3, 3), 2))
    with pytest.raises(IndexError, match="rank 2"):
        plan_layer(old, old, 0, 2)
    with pytest.raises(EplbError, match="weights has 1 ranks"):
        rearrange_in_memory(old, old, [weights_for(SHAPE, old, 0)])


# ------------------------------------------------------------------------------------------------------ properties


@st.composite
def moves(draw):
    num_layers = draw(st.integers(1, 2))
    num_logical = draw(st.integers(1, 6))
    num_local = draw(st.integers(1, 4))
    shape = ModelShape(num_layers, num_logical, num_local, hidden=2)
    min_ep = -(-num_logical // num_local)
    old_ep = draw(st.integers(min_ep, min_ep + 3), label="old_ep")
    new_ep = draw(st.integers(min_ep, min_ep + 3), label="new_ep")

    def random_placement(ep_size: int) -> Placement:
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
        return Placement(rows, ep_size, num_logical)

    old = random_placement(old_ep)
    if draw(st.booleans(), label="policy"):
        load = np.array(
            draw(st.lists(st.integers(0, 100), min_size=num_layers * num_logical, max_size=num_layers * num_logical)),
            dtype=np.int64,
        )
        new = rebalance(load.reshape(num_layers, num_logical), shape, new_ep)
    else:
        new = random_placement(new_ep)
    if new_ep <= old_ep:  # scale-down (or same size): choose the survivors and where they go
        survivors = draw(st.permutations(range(old_ep)), label="survivors")[:new_ep]
        mapping = {r: -1 for r in range(old_ep)}
        mapping.update({r: i for i, r in enumerate(survivors)})
    else:  # scale-up: old ranks go to distinct new ranks
        targets = draw(st.permutations(range(new_ep)), label="targets")[:old_ep]
        mapping = dict(enumerate(targets))
    return shape, old, new, mapping


@settings(max_examples=120, deadline=None)
@given(moves())
def test_senders_and_receivers_agree(case) -> None:
    shape, old, new, mapping = case
    space = rank_space(old, new, mapping)
    for layer in range(shape.num_layers):
        old_idx, new_idx = layer_indices(old, new, layer, mapping)
        n = shape.num_local_experts
        plans = plan_all(old, new, layer, mapping)
        assert plans == [plan_layer(old, new, layer, r, mapping) for r in range(space.size)]
        sources = plan_sources(old, new, layer, mapping)
        recvs = {(c, logical): (row, src) for c, p in enumerate(plans) for row, src, logical in p.recvs}
        sends = {(dst, logical): c for c, p in enumerate(plans) for dst, logical in p.sends}
        assert {k: v[1] for k, v in recvs.items()} == sends  # every recv has exactly one sender listing it
        assert {(c, row): src for (c, _), (row, src) in recvs.items()} == sources
        for (c, logical), (row, src) in recvs.items():
            assert src != c and logical in plans[src].old_rows and logical not in plans[c].old_rows
            assert new_idx[c * n + row] == logical
        for c, p in enumerate(plans):
            assert p.old_rows == old_idx[c * n : (c + 1) * n].tolist()
            if space.to_new[c] < 0:  # leaving: receives nothing
                assert not (p.recvs or p.local_copies or p.recv_copies)
            if space.to_old[c] < 0:  # joining: sends nothing
                assert not p.sends and not p.local_copies
            handled = set(p.unchanged) | {d for d, _ in p.local_copies} | {d for d, _, _ in p.recvs}
            handled |= {d for d, _ in p.recv_copies}
            assert handled == {row for row in range(n) if p.new_rows[row] >= 0} | set(p.unchanged)


@settings(max_examples=120, deadline=None)
@given(moves())
def test_whole_move_leaves_the_new_weights(case) -> None:
    shape, old, new, mapping = case
    space = rank_space(old, new, mapping)
    weights = [
        weights_for(shape, old if space.to_old[c] >= 0 else None, max(space.to_old[c], 0)) for c in range(space.size)
    ]
    expected_leaving = [[[t.clone() for t in layer] for layer in w] for w in weights]
    reference = [[[t.clone() for t in layer] for layer in w] for w in weights]

    # Independent of rearrange_in_memory: read every recv from a snapshot of the old weights at the row the
    # old placement gives for the source rank, then apply each rank's plan.
    for layer in range(shape.num_layers):
        snapshot = [[t.clone() for t in w[layer]] for w in weights]
        for c, plan in enumerate(plan_all(old, new, layer, mapping)):
            buffer = [torch.full_like(t, float("nan")) for t in weights[c][layer]]
            for dst_row, src, logical in plan.recvs:
                src_row = old.row_of(space.to_old[src], layer, logical)
                assert src_row >= 0
                for b, s in zip(buffer, snapshot[src]):
                    b[dst_row].copy_(s[src_row])
            apply_layer(weights[c][layer], buffer, plan)

    rearrange_in_memory(old, new, reference, mapping)
    for c in range(space.size):
        if space.to_new[c] >= 0:
            assert check_weights(weights[c], new, space.to_new[c]) == []
            assert check_weights(reference[c], new, space.to_new[c]) == []
        else:  # a leaving rank's weights are untouched
            assert all(torch.equal(a, b) for la, lb in zip(weights[c], expected_leaving[c]) for a, b in zip(la, lb))
