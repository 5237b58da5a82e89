"""EPLB state in vLLM's vocabulary: the model's expert shape, the placement of logical experts on physical slots
(``physical_to_logical`` / ``logical_to_physical``), the ``expert_load`` window, and signature-filled expert weights
that make a wrong weight move visible.

A *logical* expert is one of the model's ``num_logical_experts`` experts of a layer.  A *physical* expert is a slot
in some rank's expert weight tensors: rank ``r`` owns physical ids ``r * num_local_experts ...
(r + 1) * num_local_experts - 1``, and *row* ``i`` of its tensors is physical id ``r * num_local_experts + i``.
``num_local_experts`` stays constant across elastic reconfigurations (vLLM asserts it), so the number of physical
experts is ``num_local_experts * ep_size``.

Nothing here imports torch: the weight helpers only call tensor methods, so this module stays importable where
torch is not installed.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import EpsimError


class EplbError(EpsimError, ValueError):
    """An invalid shape, placement, load or rank mapping; the message is one line and names the culprit."""


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise EplbError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise EplbError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


# --------------------------------------------------------------------------------------------------------- shape


@dataclass(frozen=True)
class ModelShape:
    """The MoE shape of a model as EPLB sees it.

    ``num_local_experts`` is the number of physical expert slots per rank (constant across elastic changes).
    ``hidden`` is the row width of the simulated expert weight tensors.  ``num_expert_groups`` is vLLM's
    ``model.num_expert_groups`` (DeepSeek-V3's ``n_group``: 8), which the hierarchical policy packs onto nodes.
    """

    num_layers: int
    num_logical_experts: int
    num_local_experts: int
    hidden: int = 4
    num_expert_groups: int = 1

    def __post_init__(self) -> None:
        _check_int("num_layers", self.num_layers, 1)
        _check_int("num_logical_experts", self.num_logical_experts, 1)
        _check_int("num_local_experts", self.num_local_experts, 1)
        _check_int("hidden", self.hidden, 1)
        _check_int("num_expert_groups", self.num_expert_groups, 1)
        if self.num_logical_experts % self.num_expert_groups:
            raise EplbError(
                f"num_logical_experts={self.num_logical_experts} does not split into "
                f"num_expert_groups={self.num_expert_groups} equal groups"
            )

    def num_physical(self, ep_size: int) -> int:
        """Physical expert slots over the whole EP group: ``num_local_experts * ep_size``."""
        return self.num_local_experts * int(ep_size)

    def num_redundant(self, ep_size: int) -> int:
        """Physical slots beyond one per logical expert."""
        return self.num_physical(ep_size) - self.num_logical_experts

    def validate(self, ep_size: int) -> None:
        """Raise :class:`EplbError` unless every logical expert fits in ``ep_size`` ranks."""
        _check_int("ep_size", ep_size, 1)
        if self.num_physical(ep_size) < self.num_logical_experts:
            raise EplbError(
                f"num_local_experts={self.num_local_experts} x ep_size={ep_size} gives "
                f"{self.num_physical(ep_size)} physical slots, fewer than num_logical_experts="
                f"{self.num_logical_experts}"
            )


# ----------------------------------------------------------------------------------------------------- placement


def normalize_rank_mapping(
    rank_mapping: Mapping[int, int] | Sequence[int] | None, old_ep_size: int, new_ep_size: int
) -> dict[int, int]:
    """vLLM's ``rank_mapping`` (old rank -> new rank, or -1 for a removed rank) as a complete dict.

    ``None`` means identity for the ranks that fit (``old_rank < new_ep_size``) and -1 for the others.  A sequence is
    indexed by old rank.  Old ranks missing from a mapping are removed (-1).  Targets must be distinct and in
    ``range(new_ep_size)``; new ranks that no old rank maps to are *new* ranks (they start with no experts).
    """
    _check_int("old ep_size", old_ep_size, 1)
    _check_int("new ep_size", new_ep_size, 1)
    if rank_mapping is None:
        return {r: (r if r < new_ep_size else -1) for r in range(old_ep_size)}
    if isinstance(rank_mapping, Mapping):
        items = list(rank_mapping.items())
    else:
        items = list(enumerate(rank_mapping))
    out = {r: -1 for r in range(old_ep_size)}
    seen: dict[int, int] = {}
    for old, new in items:
        old = _check_int("rank_mapping key", old, 0)
        new = _check_int(f"rank_mapping[{old}]", new, -1)
        if old >= old_ep_size:
            raise EplbError(f"rank_mapping names old rank {old}, but the old ep_size is {old_ep_size}")
        if new >= new_ep_size:
            raise EplbError(f"rank_mapping[{old}]={new} is not a rank of the new ep_size={new_ep_size}")
        if new >= 0 and new in seen:
            raise EplbError(f"rank_mapping maps old ranks {seen[new]} and {old} both to new rank {new}")
        if new >= 0:
            seen[new] = old
        out[old] = new
    return out


class Placement:
    """``physical_to_logical`` (int64, ``[num_layers, num_physical]``) for one ``ep_size``; read-only.

    Every logical expert ``0 .. num_logical - 1`` appears at least once in every layer (a placement that lost an
    expert cannot serve), so the constructor raises :class:`EplbError` otherwise.  ``num_logical`` defaults to
    ``max + 1`` of the map.
    """

    __slots__ = ("_p2l", "_ep_size", "_num_logical", "_hash")
    _hash: int  # set by the first __hash__

    def __init__(self, physical_to_logical, ep_size: int, num_logical: int | None = None) -> None:
        raw = np.asarray(physical_to_logical)
        if raw.dtype.kind not in "iu" and raw.size:
            raise EplbError(f"physical_to_logical must hold integer logical ids, got dtype {raw.dtype}")
        arr = np.array(raw, dtype=np.int64, copy=True)
        ep_size = _check_int("ep_size", ep_size, 1)
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
            raise EplbError(
                f"physical_to_logical must be a non-empty [num_layers, num_physical] array, "
                f"got shape {tuple(arr.shape)}"
            )
        if arr.shape[1] % ep_size:
            raise EplbError(
                f"num_physical={arr.shape[1]} of physical_to_logical is not a multiple of ep_size={ep_size}"
            )
        if num_logical is None:
            num_logical = int(arr.max()) + 1
        num_logical = _check_int("num_logical", num_logical, 1)
        if arr.min() < 0 or arr.max() >= num_logical:
            raise EplbError(
                f"physical_to_logical holds ids outside 0..{num_logical - 1}: "
                f"min {int(arr.min())}, max {int(arr.max())}"
            )
        for layer in range(arr.shape[0]):
            present = np.zeros(num_logical, dtype=bool)
            present[arr[layer]] = True
            if not present.all():
                missing = np.flatnonzero(~present).tolist()
                raise EplbError(f"layer {layer} of physical_to_logical has no slot for logical experts {missing}")
        arr.flags.writeable = False
        self._p2l = arr
        self._ep_size = ep_size
        self._num_logical = num_logical

    # -- construction

    @classmethod
    def initial(cls, shape: ModelShape, ep_size: int) -> Placement:
        """vLLM's initial map: physical id ``p`` holds logical ``p % num_logical`` in every layer, so expert ``i``
        sits in slot ``i`` and the redundant slots go round-robin to experts 0, 1, ..."""
        shape.validate(ep_size)
        row = np.arange(shape.num_physical(ep_size), dtype=np.int64) % shape.num_logical_experts
        return cls(np.tile(row, (shape.num_layers, 1)), ep_size, shape.num_logical_experts)

    @classmethod
    def from_list(cls, rows: Sequence[Sequence[int]], ep_size: int, num_logical: int | None = None) -> Placement:
        """The inverse of :meth:`to_list`."""
        return cls(np.asarray(rows, dtype=np.int64), ep_size, num_logical)

    # -- shape

    @property
    def ep_size(self) -> int:
        return self._ep_size

    @property
    def num_layers(self) -> int:
        return int(self._p2l.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self._p2l.shape[1])

    @property
    def num_local_experts(self) -> int:
        return self.num_physical // self._ep_size

    @property
    def num_logical(self) -> int:
        return self._num_logical

    @property
    def physical_to_logical(self) -> np.ndarray:
        """The read-only ``[num_layers, num_physical]`` int64 map."""
        return self._p2l

    # -- queries

    def _check_layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        return int(layer)

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self._ep_size:
            raise IndexError(f"rank {rank} out of range 0..{self._ep_size - 1}")
        return int(rank)

    def rank_rows(self, rank: int, layer: int) -> np.ndarray:
        """Read-only view of the logical ids in ``rank``'s slots of ``layer`` (row order)."""
        rank, layer = self._check_rank(rank), self._check_layer(layer)
        n = self.num_local_experts
        return self._p2l[layer, rank * n : (rank + 1) * n]

    def local(self, rank: int, layer: int) -> list[int]:
        """The logical ids in ``rank``'s slots of ``layer``, in row order."""
        return self.rank_rows(rank, layer).tolist()

    def ranks_holding(self, layer: int, logical: int) -> list[int]:
        """Ranks with at least one slot of ``logical`` in ``layer``, ascending."""
        layer = self._check_layer(layer)
        phys = np.flatnonzero(self._p2l[layer] == logical)
        return sorted({int(p) // self.num_local_experts for p in phys})

    def row_of(self, rank: int, layer: int, logical: int) -> int:
        """The first row of ``rank``'s tensors holding ``logical`` in ``layer``, or -1."""
        hits = np.flatnonzero(self.rank_rows(rank, layer) == logical)
        return int(hits[0]) if hits.size else -1

    def logical_replica_count(self, layer: int) -> np.ndarray:
        """``[num_logical]`` int64: how many physical slots each logical expert has in ``layer``."""
        layer = self._check_layer(layer)
        return np.bincount(self._p2l[layer], minlength=self._num_logical).astype(np.int64)

    def logical_to_physical(self, layer: int) -> np.ndarray:
        """vLLM's ``logical_to_physical_map`` for one layer: ``[num_logical, max_replicas]`` int64 of physical ids,
        ascending, padded with -1."""
        layer = self._check_layer(layer)
        counts = self.logical_replica_count(layer)
        out = np.full((self._num_logical, int(counts.max())), -1, dtype=np.int64)
        fill = np.zeros(self._num_logical, dtype=np.int64)
        for phys, logical in enumerate(self._p2l[layer].tolist()):
            out[logical, fill[logical]] = phys
            fill[logical] += 1
        return out

    def to_list(self) -> list[list[int]]:
        return self._p2l.tolist()

    # -- elastic change

    def resized(self, new_ep_size: int, rank_mapping: Mapping[int, int] | Sequence[int] | None = None) -> Placement:
        """The placement after an elastic change to ``new_ep_size`` ranks.

        ``rank_mapping`` maps old rank -> new rank (-1: removed); see :func:`normalize_rank_mapping` for the
        default.  A surviving rank keeps its slots, in order, at its new rank.  A removed rank's slots are dropped;
        if that loses a logical expert of some layer, :class:`EplbError`.  The slots of a new rank (one no old rank
        maps to) are filled, rank by rank and row by row, with the logical expert that has the fewest slots so far
        (ties: lower id), avoiding one already on that rank when possible.
        """
        new_ep_size = _check_int("new_ep_size", new_ep_size, 1)
        mapping = normalize_rank_mapping(rank_mapping, self._ep_size, new_ep_size)
        n = self.num_local_experts
        out = np.full((self.num_layers, n * new_ep_size), -1, dtype=np.int64)
        for old, new in sorted(mapping.items()):
            if new >= 0:
                out[:, new * n : (new + 1) * n] = self._p2l[:, old * n : (old + 1) * n]
        targets = set(mapping.values())
        fresh = [r for r in range(new_ep_size) if r not in targets]
        removed = sorted(r for r, t in mapping.items() if t < 0)
        for layer in range(self.num_layers):
            kept = out[layer][out[layer] >= 0]
            counts = np.bincount(kept, minlength=self._num_logical)
            lost = np.flatnonzero(counts == 0).tolist()
            if lost:
                raise EplbError(
                    f"removing ranks {removed} loses logical experts {lost} of layer {layer}; "
                    f"every logical expert needs a slot on a surviving rank"
                )
            for rank in fresh:
                on_rank: set[int] = set()
                for row in range(n):
                    order = np.lexsort((np.arange(self._num_logical), counts))  # fewest slots, then lower id
                    choice = next((int(e) for e in order if int(e) not in on_rank), int(order[0]))
                    out[layer, rank * n + row] = choice
                    counts[choice] += 1
                    on_rank.add(choice)
        return Placement(out, new_ep_size, self._num_logical)

    # -- value semantics

    def digest(self) -> str:
        """16 hex digits that change with any slot of any layer, the EP size or the number of logical experts:
        what the run history records of each rebalance, so that the trace hash covers the policy's choice even
        where it moves no bytes between ranks (a reorder within a rank)."""
        h = hashlib.sha256(f"{self._ep_size},{self._num_logical},{self._p2l.shape}".encode())
        h.update(self._p2l.astype("<i8", copy=False).tobytes())
        return h.hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        if self is other:
            return True
        return (
            self._ep_size == other._ep_size
            and self._num_logical == other._num_logical
            and self._p2l.shape == other._p2l.shape
            and bool(np.array_equal(self._p2l, other._p2l))
        )

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:  # computed once: placements are immutable and key every rank's per-layer plan lookup
            self._hash = hash((self._ep_size, self._num_logical, self._p2l.shape, self._p2l.tobytes()))
            return self._hash

    def __repr__(self) -> str:
        return f"Placement(ep_size={self._ep_size}, num_logical={self._num_logical}, {self.to_list()})"


# ---------------------------------------------------------------------------------------------------- load window


class LoadWindow:
    """vLLM's ``expert_load_window``: the ``[num_layers, num_logical]`` token counts of the last ``window`` steps,
    summed by :meth:`total`.

    The simulator serves in chunks of steps, so a record may cover several steps (``steps``); the window keeps the
    newest records that cover ``window`` steps, and the oldest of them may reach further back (a window at chunk
    granularity; one step per record is vLLM's ring buffer exactly).  The engine splits serving where a periodic
    rebalance's window starts, so there it holds exactly ``window`` steps.  It holds a few arrays, not ``window`` of
    them,
    which matters at DeepSeek scale (58 x 256 per step per rank).
    """

    def __init__(self, num_layers: int, num_logical: int, window: int) -> None:
        self.num_layers = _check_int("num_layers", num_layers, 1)
        self.num_logical = _check_int("num_logical", num_logical, 1)
        self.window = _check_int("window", window, 1)
        self._records: deque[tuple[int, np.ndarray]] = deque()
        self._steps = 0  # steps covered by the records held
        self._recorded = 0

    @property
    def num_recorded(self) -> int:
        """Steps recorded since construction or :meth:`reset` (may exceed ``window``)."""
        return self._recorded

    def record(self, layer_loads: np.ndarray, steps: int = 1) -> None:
        """Add the load of ``steps`` steps; the oldest records fall out once the newer ones cover the window."""
        steps = _check_int("steps", steps, 1)
        arr = np.asarray(layer_loads)
        if arr.shape != (self.num_layers, self.num_logical):
            raise EplbError(
                f"layer_loads must have shape ({self.num_layers}, {self.num_logical}), got {tuple(arr.shape)}"
            )
        if arr.dtype.kind not in "biuf":
            raise EplbError(f"layer_loads must be numeric, got dtype {arr.dtype}")
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr) & (arr == np.floor(arr))):
            raise EplbError("layer_loads must hold whole token counts")
        if np.any(arr < 0):
            raise EplbError("layer_loads must not be negative")
        # A snapshot, since callers reuse their buffers; an int64 array that owns its data and is read-only (the
        # engine's share of a chunk's load, which every member records) is kept: the caller promises, by freezing
        # it, never to make it writeable again.
        frozen = arr.dtype == np.int64 and arr.flags.owndata and not arr.flags.writeable
        self._records.append((steps, arr if frozen else np.array(arr, dtype=np.int64)))
        self._steps += steps
        self._recorded += steps
        while len(self._records) > 1 and self._steps - self._records[0][0] >= self.window:
            self._steps -= self._records.popleft()[0]

    def total(self) -> np.ndarray:
        """``[num_layers, num_logical]`` int64: the load summed over the window."""
        out = np.zeros((self.num_layers, self.num_logical), dtype=np.int64)
        for _, loads in self._records:
            out += loads
        return out

    def reset(self) -> None:
        self._records.clear()
        self._steps = 0
        self._recorded = 0


# -------------------------------------------------------------------------------------------------------- weights


def signature(layer: int, logical: int) -> float:
    """The value every element of logical expert ``logical`` of ``layer`` holds in tensor 0 (tensor ``t`` adds
    ``t * 0.25``); exact in float32 for layers below 16000."""
    return layer * 1000.0 + logical


def _describe(value: float, tensor: int) -> str:
    base = value - tensor * 0.25
    if base >= 0 and base == int(base):
        return f"{value:g} (logical {int(base) % 1000} of layer {int(base) // 1000})"
    return f"{value:g}"


def fill_weights(weights, placement: Placement, rank: int) -> None:
    """Write each slot's signature into ``rank``'s expert weights: ``weights[layer][t]`` is a 2-D tensor
    ``[num_local_experts, hidden]``; row ``i`` of tensor ``t`` becomes ``signature(layer, logical) + t * 0.25``."""
    if len(weights) != placement.num_layers:
        raise EplbError(f"weights has {len(weights)} layers, placement has {placement.num_layers}")
    for layer, tensors in enumerate(weights):
        ids = placement.local(rank, layer)
        for t, tensor in enumerate(tensors):
            if tensor.dim() != 2 or tensor.shape[0] != len(ids):
                raise EplbError(
                    f"weights[{layer}][{t}] must be [num_local_experts={len(ids)}, hidden], got {tuple(tensor.shape)}"
                )
            # One copy per tensor: every element of row i holds its slot's signature.
            values = [signature(layer, logical) + t * 0.25 for logical in ids]
            tensor.copy_(tensor.new_tensor(values)[:, None].expand_as(tensor))


def check_weights(weights, placement: Placement, rank: int, arrays=None) -> list[str]:
    """One line per wrong row of ``rank``'s expert weights under ``placement``; empty when all are right.
    ``arrays(tensors)``, if given, returns cached numpy views of a layer's CPU tensors (``RowViews.arrays``)."""
    if len(weights) != placement.num_layers:
        return [f"rank {rank}: weights has {len(weights)} layers, placement has {placement.num_layers}"]
    if _all_right(weights, placement, rank, arrays):
        return []
    return _wrong_rows(weights, placement, rank)


def _all_right(weights, placement: Placement, rank: int, arrays=None) -> bool:
    """One vectorised comparison of every layer and tensor (the common case: after every rebalance of every
    rank); the row-by-row report runs only when something is wrong."""
    views = [arrays(layer) for layer in weights] if arrays is not None else []
    if views and all(v is not None for v in views):
        tensors = [a for layer in views for a in layer]  # numpy views: shape checks without a torch call each
    else:
        tensors = [t.detach().cpu().numpy() for layer in weights for t in layer]
    n = placement.num_local_experts
    if (
        not tensors
        or any(a.ndim != 2 for a in tensors)
        or len({a.shape for a in tensors}) != 1
        or tensors[0].shape[0] != n
    ):
        return False
    per_layer = len(weights[0])
    if any(len(layer) != per_layer for layer in weights):
        return False
    ids = placement.physical_to_logical[:, rank * n : (rank + 1) * n].astype(np.float64)  # [layers, n]
    base = np.arange(placement.num_layers, dtype=np.float64)[:, None] * 1000.0 + ids  # signature(layer, logical)
    want = base[:, None, :] + np.arange(per_layer, dtype=np.float64)[None, :, None] * 0.25  # [layers, tensors, n]
    got = np.stack(tensors).reshape(placement.num_layers, per_layer, n, -1)
    return bool((got == want[..., None]).all())


def _wrong_rows(weights, placement: Placement, rank: int) -> list[str]:
    problems: list[str] = []
    for layer, tensors in enumerate(weights):
        ids = placement.local(rank, layer)
        for t, tensor in enumerate(tensors):
            if tensor.dim() != 2 or tensor.shape[0] != len(ids):
                problems.append(
                    f"rank {rank} layer {layer} tensor {t}: shape {tuple(tensor.shape)}, expected [{len(ids)}, hidden]"
                )
                continue
            rows = tensor.detach().cpu().tolist()
            for row, logical in enumerate(ids):
                want = signature(layer, logical) + t * 0.25
                wrong = [v for v in rows[row] if v != want]
                if wrong:
                    problems.append(
                        f"rank {rank} layer {layer} tensor {t} row {row}: expected logical {logical} "
                        f"({want:g}), found {_describe(wrong[0], t)}"
                        + (f" in {len(wrong)} of {len(rows[row])} elements" if len(wrong) != len(rows[row]) else "")
                    )
    return problems
