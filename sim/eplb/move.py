"""Planning and applying one layer's expert weight move, as vLLM's ``rearrange`` does it with ``move_to_buffer`` and
``move_from_buffer`` over a receiver-initiated communicator (NIXL READs: ``add_send`` is bookkeeping, ``add_recv``
pulls the row).

For each rank and layer (vLLM's ``move_to_buffer``):

* a row whose logical expert does not change is *unchanged* and left alone;
* a row whose new expert this rank already holds (in any old row) is a *local copy*: staged from the lowest such
  old row into ``expert_buffer[dst_row]`` before anything is written, so permutations are safe;
* otherwise the rank *receives* the expert, once per expert: into ``expert_buffer`` at the lowest row that needs it,
  from a source rank chosen by :func:`plan_sources`; further rows needing the same expert are *recv copies* from
  that buffer row;
* it *sends* what others chose it as the source for (``sends``); the reader reads the sender's lowest old row
  holding the expert (``LayerPlan.send_row``, the ``expert_id -> src_row`` map of ``set_transfer_context``).

Then, once every rank's transfers of the layer are done (vLLM's barrier in ``execute``), ``move_from_buffer`` copies
the staged and received rows from ``expert_buffer`` into the weights.

Elastic changes: ``rank_mapping`` (old rank -> new rank, -1 removed) puts both placements into one *communication
rank space*, as vLLM's ``rearrange`` does.  Scale-down runs on the old group: ranks are old ranks, a removed rank
still sends but receives nothing (its new rows are all -1).  Scale-up runs on the new group: ranks are new ranks, a
new rank has nothing in ``old`` (its old rows are all -1) so it only receives.  Without a mapping the two placements
must have the same ``ep_size`` (or the default mapping of :func:`~sim.eplb.state.normalize_rank_mapping` applies).

Everything here is a function of (old, new, layer, rank_mapping), so every rank computes the same plan for the whole
layer.  Tensors are only touched through their methods; torch is not imported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .state import EplbError, Placement, normalize_rank_mapping

RankMapping = Mapping[int, int] | Sequence[int] | None


@dataclass(frozen=True)
class RankSpace:
    """The ranks a move runs over.  ``to_old[c]`` / ``to_new[c]``: the old / new rank of communication rank ``c``
    (-1: none; a rank being removed has no new rank, a rank being added no old one).  ``group`` is ``"old"`` for a
    move on the old group (same size, scale-down) and ``"new"`` for one on the new group (scale-up)."""

    group: str
    to_old: tuple[int, ...]
    to_new: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.to_old)


def rank_space(old: Placement, new: Placement, rank_mapping: RankMapping = None) -> RankSpace:
    """The communication ranks for moving from ``old`` to ``new``; see the module docstring."""
    for what in ("num_layers", "num_local_experts", "num_logical"):
        if getattr(old, what) != getattr(new, what):
            raise EplbError(f"old and new placements differ in {what}: {getattr(old, what)} vs {getattr(new, what)}")
    mapping = normalize_rank_mapping(rank_mapping, old.ep_size, new.ep_size)
    targets = {t for t in mapping.values() if t >= 0}
    if len(targets) == new.ep_size:  # every new rank is an old one: run on the old group
        return RankSpace("old", tuple(range(old.ep_size)), tuple(mapping[r] for r in range(old.ep_size)))
    if all(t >= 0 for t in mapping.values()):  # nobody leaves: run on the new group
        inverse = {t: r for r, t in mapping.items()}
        return RankSpace("new", tuple(inverse.get(c, -1) for c in range(new.ep_size)), tuple(range(new.ep_size)))
    raise EplbError(f"rank_mapping {mapping} both removes ranks and adds new ones; do one at a time")


def layer_indices(
    old: Placement, new: Placement, layer: int, rank_mapping: RankMapping = None
) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's ``old_global_expert_indices`` / ``new_global_expert_indices`` for one layer in the communication rank
    space: two flat int64 arrays of ``space.size * num_local_experts`` logical ids, -1 for a slot with no expert."""
    space = rank_space(old, new, rank_mapping)
    n = old.num_local_experts
    old_idx = np.full(space.size * n, -1, dtype=np.int64)
    new_idx = np.full(space.size * n, -1, dtype=np.int64)
    for c in range(space.size):
        if space.to_old[c] >= 0:
            old_idx[c * n : (c + 1) * n] = old.rank_rows(space.to_old[c], layer)
        if space.to_new[c] >= 0:
            new_idx[c * n : (c + 1) * n] = new.rank_rows(space.to_new[c], layer)
    return old_idx, new_idx


@dataclass(frozen=True)
class LayerPlan:
    """What one rank does to move one layer.  Ranks are communication ranks (:class:`RankSpace`), rows index the
    rank's ``[num_local_experts, hidden]`` tensors and its ``expert_buffer``."""

    layer: int
    rank: int
    old_rows: list[int]  # logical id per row before the move (-1: none)
    new_rows: list[int]  # logical id per row after the move (-1: none)
    unchanged: list[int] = field(default_factory=list)  # rows left alone
    local_copies: list[tuple[int, int]] = field(default_factory=list)  # (dst_row, src_row), staged via the buffer
    recvs: list[tuple[int, int, int]] = field(default_factory=list)  # (dst_row, src_rank, logical), by logical
    recv_copies: list[tuple[int, int]] = field(default_factory=list)  # (dst_row, buffer_row) of a received expert
    sends: list[tuple[int, int]] = field(default_factory=list)  # (dst_rank, logical), by logical then rank

    def send_row(self, logical: int) -> int:
        """The row a reader of ``logical`` reads from this rank: the lowest old row holding it (-1: none)."""
        return self.old_rows.index(logical) if logical in self.old_rows else -1

    @property
    def is_noop(self) -> bool:
        return not (self.local_copies or self.recvs or self.recv_copies or self.sends)


def _rows(old: Placement, new: Placement, layer: int, rank_mapping: RankMapping):
    old_idx, new_idx = layer_indices(old, new, layer, rank_mapping)
    n = old.num_local_experts
    return old_idx.reshape(-1, n).tolist(), new_idx.reshape(-1, n).tolist()


def _needs(old_rows: list[int], new_rows: list[int]):
    """(unchanged, local_copies, first rows to receive {logical: row}, recv_copies) of one rank."""
    unchanged, local, recv_copies = [], [], []
    first_recv: dict[int, int] = {}
    for row, (was, want) in enumerate(zip(old_rows, new_rows)):
        if was == want:
            unchanged.append(row)
        elif want == -1:
            continue
        elif want in old_rows:
            local.append((row, old_rows.index(want)))
        elif want in first_recv:
            recv_copies.append((row, first_recv[want]))
        else:
            first_recv[want] = row
    return unchanged, local, first_recv, recv_copies


def _sources(
    old_rows: list[list[int]], new_rows: list[list[int]], layer: int, needs: list[tuple] | None = None
) -> dict[tuple[int, int], int]:
    """``needs``: every rank's :func:`_needs`, if the caller has them already."""
    if needs is None:
        needs = [_needs(o, n) for o, n in zip(old_rows, new_rows)]
    wanted: list[tuple[int, int, int]] = []  # (logical, dst_rank, dst_row)
    for dst, (_, _, first_recv, _) in enumerate(needs):
        wanted.extend((logical, dst, row) for logical, row in first_recv.items())
    holding: dict[int, list[int]] = {}  # logical -> the ranks holding it before the move, ascending
    for r, rows in enumerate(old_rows):
        for logical in dict.fromkeys(rows):
            holding.setdefault(logical, []).append(r)
    receivers: dict[int, list[tuple[int, int]]] = {}  # logical -> its receivers (dst_rank, dst_row), ascending
    for logical, dst, row in sorted(wanted):
        receivers.setdefault(logical, []).append((dst, row))
    out: dict[tuple[int, int], int] = {}
    for logical, recv in receivers.items():
        holders = holding.get(logical)
        if not holders:
            raise EplbError(
                f"logical expert {logical} of layer {layer} is needed by rank {recv[0][0]} but no rank "
                f"holds it before the move"
            )
        # vLLM's pairing: each holder serves a contiguous run of len(recv) // len(holders) receivers, in rank order,
        # and the receivers left over go one to each holder from the first.
        per = len(recv) // len(holders)
        paired = len(holders) * per
        for pos, key in enumerate(recv):
            out[key] = holders[pos // per] if pos < paired else holders[pos - paired]
    return dict(sorted(out.items()))


def plan_sources(
    old: Placement, new: Placement, layer: int, rank_mapping: RankMapping = None
) -> dict[tuple[int, int], int]:
    """``{(dst_rank, dst_row): src_rank}`` for every expert received in ``layer``, one entry per (rank, expert) at
    the lowest row that needs it.  As vLLM pairs them: an expert's receivers (ranks that need it and do not hold it,
    ascending) are split into contiguous runs, one per rank holding it in ``old`` (ascending), the remainder one per
    holder from the first."""
    old_rows, new_rows = _rows(old, new, layer, rank_mapping)
    return _sources(old_rows, new_rows, layer)


def _sends_by_rank(new_rows, sources) -> dict[int, list[tuple[int, int]]]:
    """``{src_rank: [(dst_rank, logical)]}`` by logical then destination rank."""
    out: dict[int, list[tuple[int, int]]] = {}
    for (dst, row), src in sources.items():
        out.setdefault(src, []).append((dst, new_rows[dst][row]))
    for sends in out.values():
        sends.sort(key=lambda x: (x[1], x[0]))
    return out


def _plan(old_rows, new_rows, layer: int, rank: int, sources, sends_by_rank=None, needs=None) -> LayerPlan:
    unchanged, local, first_recv, recv_copies = needs if needs is not None else _needs(old_rows[rank], new_rows[rank])
    recvs = sorted(((row, sources[(rank, row)], logical) for logical, row in first_recv.items()), key=lambda x: x[2])
    if sends_by_rank is None:
        sends_by_rank = _sends_by_rank(new_rows, sources)
    sends = sends_by_rank.get(rank, [])
    return LayerPlan(
        layer, rank, list(old_rows[rank]), list(new_rows[rank]), unchanged, local, recvs, recv_copies, sends
    )


def plan_layer(old: Placement, new: Placement, layer: int, rank: int, rank_mapping: RankMapping = None) -> LayerPlan:
    """The plan of communication rank ``rank`` for ``layer``."""
    old_rows, new_rows = _rows(old, new, layer, rank_mapping)
    if not 0 <= rank < len(old_rows):
        raise IndexError(f"rank {rank} out of range 0..{len(old_rows) - 1} of the move's rank space")
    return _plan(old_rows, new_rows, layer, rank, _sources(old_rows, new_rows, layer))


def plan_all(old: Placement, new: Placement, layer: int, rank_mapping: RankMapping = None) -> list[LayerPlan]:
    """Every communication rank's plan for ``layer`` (index = rank)."""
    old_rows, new_rows = _rows(old, new, layer, rank_mapping)
    needs = [_needs(o, n) for o, n in zip(old_rows, new_rows)]
    sources = _sources(old_rows, new_rows, layer, needs)
    sends = _sends_by_rank(new_rows, sources)
    return [_plan(old_rows, new_rows, layer, r, sources, sends, needs[r]) for r in range(len(old_rows))]


# ------------------------------------------------------------------------------------------------ applying a plan


def stage_local_copies(weights_layer, buffer, plan: LayerPlan, arrays=None) -> None:
    """The local part of ``move_to_buffer``: ``buffer[t][dst] = weights_layer[t][src]`` for every local copy.
    Only reads the weights, so peers may still be reading them.  ``arrays``: as for :func:`_copy_rows`."""
    _copy_rows(buffer, weights_layer, plan.local_copies, arrays)


_ROW_BY_ROW = 8  # up to this many rows, host copies go row by row (measured: 4.6 us against 9.2 us for 4 rows)


def _copy_rows(into, source, rows: list[tuple[int, int]], arrays=None) -> None:
    """``into[t][dst] = source[t][src]`` for every (dst, src) in ``rows`` (distinct dst rows): host tensors row by
    row for a few rows, else in one indexed numpy copy per tensor; device tensors in one non_blocking copy per row.
    ``arrays(tensors)``, if given, returns cached numpy views of a list of CPU tensors (None for others), e.g.
    :meth:`RowViews.arrays`."""
    if len(into) != len(source):
        raise ValueError(f"{len(into)} tensors to write, {len(source)} to read")
    if not rows:
        return
    if arrays is not None:
        into_np, source_np = arrays(into), arrays(source)
    elif len(rows) > 1 and all(t.device.type == "cpu" and not t.requires_grad for t in (*into, *source)):
        into_np, source_np = [t.numpy() for t in into], [t.numpy() for t in source]
    else:
        into_np = source_np = None
    if into_np is not None and source_np is not None:
        # numpy views share the tensors' memory and index at a fraction of the cost
        if len(rows) <= _ROW_BY_ROW and not any(a is b for a, b in zip(into_np, source_np)):
            # A few rows (a layer's move on one rank): one numpy row copy each costs half of building two index
            # arrays and a gather and a scatter per tensor.  (Distinct arrays: a row read is never one written.)
            for a, b in zip(into_np, source_np):
                for dst, src in rows:
                    a[dst] = b[src]
            return
        dst_i = np.array([d for d, _ in rows], dtype=np.intp)
        src_i = np.array([s for _, s in rows], dtype=np.intp)
        for a, b in zip(into_np, source_np):
            a[dst_i] = b[src_i]
        return
    # Device tensors: one non_blocking copy per row, as vLLM's move_to_buffer/move_from_buffer issue them.  An index
    # tensor built from a Python list would be a host-to-device copy that waits for the stream, an ordering vLLM's
    # copies do not have (it would hide the race of sim/device.py on a GPU).
    for dst, src in rows:
        for a, b in zip(into, source):
            a[dst].copy_(b[src], non_blocking=True)


def move_from_buffer(weights_layer, buffer, plan: LayerPlan, arrays=None) -> None:
    """vLLM's ``move_from_buffer``: write staged local copies, received rows and their recv copies from the
    ``expert_buffer`` into the weights.  Call after every rank's transfers of the layer are complete."""
    rows = [(dst, dst) for dst, _ in plan.local_copies]
    rows += [(dst, dst) for dst, _, _ in plan.recvs]
    rows += list(plan.recv_copies)
    _copy_rows(weights_layer, buffer, rows, arrays)


def apply_layer(weights_layer, buffer, plan: LayerPlan) -> None:
    """Finish one rank's layer once its received rows are in ``buffer`` (at each recv's ``dst_row``): stage the
    local copies, then :func:`move_from_buffer`.  ``weights_layer`` and ``buffer`` are lists of
    ``[num_local_experts, hidden]`` tensors, one per weight tensor of the layer."""
    stage_local_copies(weights_layer, buffer, plan)
    move_from_buffer(weights_layer, buffer, plan)


def rearrange_in_memory(old: Placement, new: Placement, weights, rank_mapping: RankMapping = None) -> None:
    """Reference execution of a whole rearrange on in-memory tensors: ``weights[c][layer][t]`` are the expert
    weights of communication rank ``c`` (a rank being added holds anything).  Layer by layer, every rank reads its
    recvs from the source's old rows, then every rank applies its plan.  Raises :class:`EplbError` when a receiver's
    source does not list the send."""
    space = rank_space(old, new, rank_mapping)
    if len(weights) != space.size:
        raise EplbError(f"weights has {len(weights)} ranks, the move runs over {space.size}")
    for layer in range(old.num_layers):
        plans = plan_all(old, new, layer, rank_mapping)
        buffers = []
        for c, plan in enumerate(plans):
            buf = [w.new_full(tuple(w.shape), float("nan")) for w in weights[c][layer]]
            for dst_row, src, logical in plan.recvs:
                if (c, logical) not in plans[src].sends:
                    raise EplbError(
                        f"layer {layer}: rank {c} reads logical {logical} from rank {src}, which does "
                        f"not list that send"
                    )
                src_row = plans[src].send_row(logical)
                for b, w in zip(buf, weights[src][layer], strict=True):
                    b[dst_row].copy_(w[src_row])
            stage_local_copies(weights[c][layer], buf, plan)
            buffers.append(buf)
        for c, plan in enumerate(plans):
            move_from_buffer(weights[c][layer], buffers[c], plan)


class RowViews:
    """``rows(tensors, row)`` is ``[t[row] for t in tensors]``: the per-expert views vLLM passes to add_send and
    add_recv.  Storage never moves under a list of tensors (a moved buffer is a new list), so the views are made once
    per (list, row); each caller gets a list of its own."""

    def __init__(self) -> None:
        self._views: dict[tuple[int, int], tuple[list, list]] = {}  # (id(tensor list), row) -> (that list, views)
        self._arrays: dict[int, tuple[list, list | None]] = {}  # id(tensor list) -> (that list, numpy views)

    def __call__(self, tensors: list, row: int) -> list:
        key = (id(tensors), row)
        views = self._views.get(key)
        if views is None or views[0] is not tensors:
            views = self._views[key] = (tensors, [t[row] for t in tensors])
        return list(views[1])

    def arrays(self, tensors: list) -> list | None:
        """numpy views of a list of CPU tensors, made once per list (None if one is not a plain CPU tensor): a
        layer's row copies index these instead of converting every tensor twice per layer."""
        got = self._arrays.get(id(tensors))
        if got is None or got[0] is not tensors:
            plain = all(t.device.type == "cpu" and not t.requires_grad for t in tensors)
            got = self._arrays[id(tensors)] = (tensors, [t.numpy() for t in tensors] if plain else None)
        return got[1]


def move_layer(
    comm, layer: int, old_indices: Sequence[int] | np.ndarray, weights_layer, buffer, plan: LayerPlan, rows, stream=None
) -> None:
    """One layer of vLLM's ``rearrange_expert_weights_inplace`` through an EPLB communicator: the transfer context,
    local copies staged in ``expert_buffer``, every send and recv, ``execute()``, then the buffer into the weights.
    ``rows(tensors, row)`` gives the per-expert views passed to ``add_send``/``add_recv``.  The real worker moves
    through here and the simulated one through its two halves (with a calibrated copy time between them), so the
    code under test sees the same call sequence in every world.
    ``stream`` (``submit(op, what)``: a :class:`sim.device.DeviceStream`, or the real backend's lagging CUDA stream)
    runs the two row copies, as vLLM's non_blocking copies run on the current CUDA stream; without one they run at
    once."""
    transfer_layer(comm, layer, old_indices, weights_layer, buffer, plan, rows, stream)
    issue_move_from_buffer(weights_layer, buffer, plan, rows, stream, layer)


def transfer_layer(
    comm, layer: int, old_indices: Sequence[int] | np.ndarray, weights_layer, buffer, plan: LayerPlan, rows, stream=None
) -> None:
    """The first part of :func:`move_layer` (vLLM's ``transfer_layer``): local copies staged in ``expert_buffer`` on
    ``stream``, then the transfer context, every send and recv, ``execute()``, in the order of vLLM 0.33.0's
    ``move_to_buffer`` (a ``set_transfer_context`` that synchronizes the stream, as its ROCm branch does, waits for
    the layer's own local copies too).  Async EPLB does this on its own thread and leaves ``move_from_buffer`` to
    the main thread."""
    arrays = getattr(rows, "arrays", None)
    issue = stream.submit if stream is not None else _at_once
    issue(lambda: stage_local_copies(weights_layer, buffer, plan, arrays), f"stage layer {layer}")
    comm.set_transfer_context(old_indices, layer)
    for dst_rank, logical in plan.sends:
        comm.add_send(rows(weights_layer, plan.send_row(logical)), dst_rank, logical)
    for dst_row, src_rank, logical in plan.recvs:
        comm.add_recv(rows(buffer, dst_row), src_rank, logical)
    comm.execute()


def issue_move_from_buffer(weights_layer, buffer, plan: LayerPlan, rows, stream, layer: int) -> None:
    """:func:`move_from_buffer` as a copy issued on ``stream`` (at once without one)."""
    arrays = getattr(rows, "arrays", None)
    issue = stream.submit if stream is not None else _at_once
    issue(lambda: move_from_buffer(weights_layer, buffer, plan, arrays), f"move_from_buffer layer {layer}")


def _at_once(op, what: str) -> None:
    """Row copies without a stream: they run when issued."""
    op()
