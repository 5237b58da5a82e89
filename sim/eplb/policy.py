"""A deterministic rebalance policy in the spirit of vLLM's default EPLB policy, and its balancedness metric.

Per layer:

1. *Replicate.*  Every logical expert gets one physical slot; each redundant slot goes, one at a time, to the
   expert with the highest load per replica (ties: fewer replicas, then lower logical id) among those with fewer
   than ``ep_size`` replicas (a further replica would share a rank with another and relieve no rank).
2. *Pack.*  Replicas, heaviest first (ties: lower logical id), go to the least loaded rank that still has a free
   slot and does not hold that expert yet (ties: lower rank); only when every rank with a free slot already holds
   the expert may a rank get a second replica.  A repair pass then swaps slots between ranks while that removes a
   duplicate.  Each rank's slots are listed in ascending logical id.
3. *Keep slots.*  Given the placement it replaces, every rank in both (a rank keeps its index when the group grows
   or shrinks) puts the experts it keeps back in their old slots, and the newcomers in the slots left: vLLM's
   ``preserve_intragpu_slots``, which its default policy applies whenever it is given the current map (the
   rearrange always gives it).  Those rows are then left alone instead of copied inside the rank.

A replica is assumed to serve ``load / replicas`` tokens.  No randomness: the same load gives the same placement.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from .state import EplbError, ModelShape, Placement


def _check_load(load: np.ndarray, num_layers: int, num_logical: int) -> np.ndarray:
    arr = np.asarray(load)
    if arr.shape != (num_layers, num_logical):
        raise EplbError(f"load must have shape (num_layers={num_layers}, num_logical_experts={num_logical}), "
                        f"got {tuple(arr.shape)}")
    if arr.dtype.kind not in "biuf":
        raise EplbError(f"load must be numeric, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise EplbError("load must be finite and not negative")
    return arr


def replica_counts(layer_load: np.ndarray, num_physical: int, ep_size: int | None = None) -> np.ndarray:
    """``[num_logical]`` int64: how many slots each logical expert of one layer gets (sums to ``num_physical``).

    Each redundant slot goes to the expert with the highest load per replica (ties: fewer replicas, then lower
    id).  With ``ep_size``, an expert gets more than ``ep_size`` replicas only once every expert has ``ep_size``:
    a replica beyond that would share a rank with another one and take no load off that rank.
    """
    layer_load = np.asarray(layer_load, dtype=np.float64)
    num_logical = layer_load.shape[0]
    if num_physical < num_logical:
        raise EplbError(f"num_physical={num_physical} is fewer than num_logical_experts={num_logical}")
    counts = [1] * num_logical
    loads = layer_load.tolist()
    # A heap ordered as the rule reads: highest load per replica, then fewer replicas, then lower id.  Experts at
    # the ep_size cap wait aside while any expert is under it.
    heap = [(-loads[e], 1, e) for e in range(num_logical)]
    heapq.heapify(heap)
    capped: list[tuple[float, int, int]] = []
    for _ in range(num_physical - num_logical):
        if ep_size is not None:
            while heap and heap[0][1] >= ep_size:
                capped.append(heapq.heappop(heap))
            if not heap:  # every expert has ep_size replicas: the cap no longer applies
                heap, capped = capped, []
                heapq.heapify(heap)
        _, _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-(loads[e] / counts[e]), counts[e], e))
    return np.asarray(counts, dtype=np.int64)


def _pack_layer(layer_load: np.ndarray, counts: np.ndarray, ep_size: int, num_local: int) -> list[list[int]]:
    per_replica = (layer_load / counts).tolist()
    replicas = sorted((-per_replica[e], e) for e in range(len(counts)) for _ in range(int(counts[e])))
    slots: list[list[int]] = [[] for _ in range(ep_size)]
    held: list[set[int]] = [set() for _ in range(ep_size)]
    rank_load = [0.0] * ep_size
    # Ranks with a free slot, least loaded first (ties: lower rank); a rank leaves the heap when it is full.
    heap = [(0.0, r) for r in range(ep_size)]
    for neg_load, e in replicas:
        skipped = []
        while heap and e in held[heap[0][1]]:
            skipped.append(heapq.heappop(heap))
        if heap:
            _, r = heapq.heappop(heap)
        else:  # every rank with a free slot already holds e: the least loaded of them takes a second replica
            _, r = skipped.pop(0)
        for item in skipped:
            heapq.heappush(heap, item)
        slots[r].append(e)
        held[r].add(e)
        rank_load[r] += -neg_load
        if len(slots[r]) < num_local:
            heapq.heappush(heap, (rank_load[r], r))
    _remove_duplicates(slots)
    return [sorted(s) for s in slots]


def _remove_duplicates(slots: list[list[int]]) -> None:
    """Swap slots between ranks while that lowers the number of duplicated replicas on a rank (each swap removes
    one duplicate, so this ends)."""
    while True:
        for a, rank_a in enumerate(slots):
            dup = next((e for e in sorted(set(rank_a)) if rank_a.count(e) > 1), None)
            if dup is None:
                continue
            for b, rank_b in enumerate(slots):
                if b == a or dup in rank_b:
                    continue
                other = next((f for f in sorted(set(rank_b)) if f not in rank_a), None)
                if other is not None:
                    rank_a[rank_a.index(dup)] = other
                    rank_b[rank_b.index(other)] = dup
                    break
            else:
                continue
            break  # swapped: rescan from the start
        else:
            return


def preserve_slots(new_rows: Sequence[int], old_rows: Sequence[int]) -> list[int]:
    """vLLM's ``preserve_intragpu_slots`` for one rank and layer: ``new_rows`` reordered so that an expert the rank
    keeps stays in its old slot and is not copied at all.  Old slots are visited in order, each taking the first
    not yet placed replica of its old expert; the remaining new experts fill the other slots in their new order."""
    placed: list[int | None] = [None] * len(new_rows)
    free = list(new_rows)  # new experts not yet placed (None once placed)
    for slot, was in enumerate(old_rows[:len(new_rows)]):
        if was in free:
            i = free.index(was)
            placed[slot], free[i] = was, None
    rest = iter(e for e in free if e is not None)
    return [e if e is not None else next(rest) for e in placed]


def rebalance(load: np.ndarray, shape: ModelShape, ep_size: int, previous: Placement | None = None) -> Placement:
    """The placement for ``ep_size`` ranks given the ``[num_layers, num_logical_experts]`` load (e.g.
    :meth:`~sim.eplb.state.LoadWindow.total` after the all-reduce).  ``previous``: the placement being replaced;
    every rank that exists in both keeps the experts it keeps in their old slots (:func:`preserve_slots`), as vLLM's
    default policy does when it is given the current map (it always is, also when the group grows or shrinks: a
    rank keeps its index)."""
    shape.validate(ep_size)
    arr = _check_load(load, shape.num_layers, shape.num_logical_experts)
    num_local = shape.num_local_experts
    out = np.empty((shape.num_layers, shape.num_physical(ep_size)), dtype=np.int64)
    kept = 0 if previous is None else min(ep_size, previous.ep_size)
    if previous is not None and previous.num_local_experts != num_local:
        raise EplbError(f"previous placement has {previous.num_local_experts} slots per rank, the shape "
                        f"{num_local}")
    for layer in range(shape.num_layers):
        counts = replica_counts(arr[layer], shape.num_physical(ep_size), ep_size)
        for rank, ids in enumerate(_pack_layer(arr[layer], counts, ep_size, num_local)):
            if rank < kept:
                ids = preserve_slots(ids, previous.rank_rows(rank, layer).tolist())
            out[layer, rank * num_local:(rank + 1) * num_local] = ids
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
