"""A deterministic rebalance policy with the semantics of vLLM's default EPLB policy (``DefaultEplbPolicy``, after
DeepSeek's EPLB), and its balancedness metric.

Per layer:

1. *Replicate.*  Every logical expert gets one physical slot; each redundant slot goes, one at a time, to the expert
   with the highest load per replica (ties: the lower logical id).  Nothing caps the replicas of one expert.
2. *Pack.*  Physical experts, heaviest per replica first (ties: the lower physical index), each go to the lightest
   rank that still has a free slot (ties: the lower rank).  Nothing keeps two replicas of one expert off the same
   rank, as in vLLM; such a rank serves the expert from either row.  A rank's slots are in the order it got them.
   When every rank has one slot the i-th physical expert goes to rank i, as vLLM packs one item per pack.
3. *Hierarchical* when the model's expert groups split evenly over the group's nodes (DeepSeek-V3: 8 groups; EP64
   on 8-GPU nodes is 8 nodes): first the groups are packed onto nodes by their summed load, then each node
   replicates its own experts into its share of the slots and packs them onto its ranks, so that no replica crosses
   a node.  Otherwise the *global* policy: the same with one group and one node.  As in vLLM, a group whose size is
   not a multiple of the node count is placed as if on one node (its groups still set the experts' order).
4. *Keep slots.*  Given the placement it replaces, every rank in both (a rank keeps its index when the group grows
   or shrinks) puts the experts it keeps back in their old slots, and the newcomers in the slots left: vLLM's
   ``preserve_intragpu_slots``, which its default policy applies whenever it is given the current map (the
   rearrange always gives it).  Those rows are then left alone instead of copied inside the rank.

A replica is assumed to serve ``load / replicas`` tokens.  No randomness: the same load gives the same placement.
vLLM sorts with an unstable sort, so its choice among exactly equal loads (an idle layer) is unspecified; here the
lower index wins.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from .state import EplbError, ModelShape, Placement


def _check_load(load: np.ndarray, num_layers: int, num_logical: int) -> np.ndarray:
    arr = np.asarray(load)
    if arr.shape != (num_layers, num_logical):
        raise EplbError(
            f"load must have shape (num_layers={num_layers}, num_logical_experts={num_logical}), got {tuple(arr.shape)}"
        )
    if arr.dtype.kind not in "biuf":
        raise EplbError(f"load must be numeric, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise EplbError("load must be finite and not negative")
    return arr


def replicate(loads: Sequence[float], num_physical: int) -> tuple[list[int], list[int]]:
    """``(phy2log, counts)`` of one layer: physical slot ``i < len(loads)`` is logical ``i``; each later slot is the
    expert with the highest load per replica at that point (ties: lower id).  ``counts`` sums to ``num_physical``."""
    num_logical = len(loads)
    if num_physical < num_logical:
        raise EplbError(f"num_physical={num_physical} is fewer than num_logical_experts={num_logical}")
    counts = [1] * num_logical
    phy2log = list(range(num_logical))
    heap = [(-loads[e], e) for e in range(num_logical)]  # highest load per replica first, then lower id
    heapq.heapify(heap)
    for _ in range(num_physical - num_logical):
        _, e = heapq.heappop(heap)
        phy2log.append(e)
        counts[e] += 1
        heapq.heappush(heap, (-(loads[e] / counts[e]), e))
    return phy2log, counts


def balanced_packing(weights: Sequence[float], num_packs: int) -> list[list[int]]:
    """Items into ``num_packs`` packs of ``len(weights) // num_packs`` each, heaviest first (ties: lower index) into
    the lightest pack with room (ties: lower pack); returns each pack's items in the order it got them.  With one
    item per pack, item ``i`` goes to pack ``i``."""
    per_pack = len(weights) // num_packs
    if per_pack * num_packs != len(weights):
        raise EplbError(f"{len(weights)} items do not split evenly into {num_packs} packs")
    if per_pack == 1:
        return [[i] for i in range(num_packs)]
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    heap = [(0.0, p) for p in range(num_packs)]  # (load, pack) of packs with room; a full pack leaves the heap
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, p = heapq.heappop(heap)
        packs[p].append(item)
        if len(packs[p]) < per_pack:
            heapq.heappush(heap, (load + weights[item], p))
    return packs


def node_layout(num_groups: int, num_nodes: int, ep_size: int) -> tuple[int, int]:
    """The ``(groups, nodes)`` vLLM's rearrange gives its policy: one node when the ranks do not split evenly over
    the nodes, and the global policy (one group, one node) when the groups do not."""
    if num_nodes < 1 or ep_size % num_nodes:
        num_nodes = 1
    if num_groups % num_nodes:
        return 1, 1
    return num_groups, num_nodes


def _layer(loads: list[float], num_physical: int, ep_size: int, num_groups: int, num_nodes: int) -> list[list[int]]:
    """Each rank's logical experts, in slot order, for one layer."""
    num_logical = len(loads)
    group_size = num_logical // num_groups
    # 1. Groups onto nodes by their summed load; a node's experts, in its order, are its groups' experts in turn.
    group_loads = [sum(loads[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    ranks_per_node = ep_size // num_nodes
    out: list[list[int]] = []
    for groups in balanced_packing(group_loads, num_nodes):
        experts = [g * group_size + j for g in groups for j in range(group_size)]
        # 2. Replicate the node's experts into its share of the slots; 3. pack them onto the node's ranks.
        phy2local, counts = replicate([loads[e] for e in experts], num_physical // num_nodes)
        per_replica = [loads[experts[i]] / counts[i] for i in phy2local]
        for pack in balanced_packing(per_replica, ranks_per_node):
            out.append([experts[phy2local[i]] for i in pack])
    return out


def preserve_slots(new_rows: Sequence[int], old_rows: Sequence[int]) -> list[int]:
    """vLLM's ``preserve_intragpu_slots`` for one rank and layer: ``new_rows`` reordered so that an expert the rank
    keeps stays in its old slot and is not copied at all.  Old slots are visited in order, each taking the first
    not yet placed replica of its old expert; the remaining new experts fill the other slots in their new order."""
    placed: list[int | None] = [None] * len(new_rows)
    free: list[int | None] = list(new_rows)  # new experts not yet placed (None once placed)
    for slot, was in enumerate(old_rows[: len(new_rows)]):
        if was in free:
            i = free.index(was)
            placed[slot], free[i] = was, None
    rest = iter(e for e in free if e is not None)
    return [e if e is not None else next(rest) for e in placed]


def rebalance(
    load: np.ndarray, shape: ModelShape, ep_size: int, previous: Placement | None = None, num_nodes: int = 1
) -> Placement:
    """The placement for ``ep_size`` ranks on ``num_nodes`` nodes given the ``[num_layers, num_logical_experts]``
    load (e.g. :meth:`~sim.eplb.state.LoadWindow.total` after the all-reduce).  ``previous``: the placement being
    replaced; every rank that exists in both keeps the experts it keeps in their old slots (:func:`preserve_slots`),
    as vLLM's default policy does when it is given the current map (it always is, also when the group grows or
    shrinks: a rank keeps its index)."""
    shape.validate(ep_size)
    arr = _check_load(load, shape.num_layers, shape.num_logical_experts)
    num_local = shape.num_local_experts
    if previous is not None and previous.num_local_experts != num_local:
        raise EplbError(f"previous placement has {previous.num_local_experts} slots per rank, the shape {num_local}")
    groups, nodes = node_layout(shape.num_expert_groups, num_nodes, ep_size)
    num_physical = shape.num_physical(ep_size)
    out = np.empty((shape.num_layers, num_physical), dtype=np.int64)
    kept = 0 if previous is None else min(ep_size, previous.ep_size)
    for layer in range(shape.num_layers):
        for rank, ids in enumerate(_layer(arr[layer].tolist(), num_physical, ep_size, groups, nodes)):
            if rank < kept and previous is not None:
                ids = preserve_slots(ids, previous.rank_rows(rank, layer).tolist())
            out[layer, rank * num_local : (rank + 1) * num_local] = ids
    return Placement(out, ep_size, shape.num_logical_experts)


def rank_loads(load: np.ndarray, placement: Placement) -> np.ndarray:
    """``[num_layers, ep_size]`` float64: tokens each rank serves when an expert's load splits evenly over its
    replicas."""
    arr = _check_load(load, placement.num_layers, placement.num_logical)
    out = np.zeros((placement.num_layers, placement.ep_size), dtype=np.float64)
    n = placement.num_local_experts
    for layer in range(placement.num_layers):
        p2l = placement.physical_to_logical[layer]
        per_slot = arr[layer][p2l] / placement.logical_replica_count(layer)[p2l]
        out[layer] = per_slot.reshape(placement.ep_size, n).sum(axis=1)
    return out


def balancedness(load: np.ndarray, placement: Placement) -> float:
    """vLLM's metric: sum over layers of the mean rank load over sum over layers of the max rank load; 1.0 is
    perfect (and is returned when there is no load)."""
    per_rank = rank_loads(load, placement)
    worst = float(per_rank.max(axis=1).sum())
    if worst == 0.0:
        return 1.0
    return min(1.0, float(per_rank.mean(axis=1).sum()) / worst)  # mean <= max; clamp float rounding


# vLLM 0.33.0 on ROCm skips a periodic synchronous rebalance that would not cut the rank load imbalance by this much
# (EplbState.rearrange: "Skip rearrange: ... (no material gain)").
ROCM_MIN_GAIN = 0.05


def rank_load_imbalance(load: np.ndarray, placement: Placement) -> float:
    """vLLM's ROCm measure: the most loaded rank's tokens over the mean, summed over every layer (1.0: no load)."""
    per_rank = rank_loads(load, placement).sum(axis=0)
    mean = float(per_rank.mean())
    return 1.0 if mean == 0.0 else float(per_rank.max()) / mean


def gains_enough(load: np.ndarray, current: Placement, proposed: Placement, threshold: float = ROCM_MIN_GAIN) -> bool:
    """Whether ``proposed`` cuts :func:`rank_load_imbalance` by at least ``threshold`` relative to ``current``."""
    now = rank_load_imbalance(load, current)
    return (now - rank_load_imbalance(load, proposed)) / now >= threshold
