"""vLLM 0.33's NIXL EPLB data path, shared by the built-in strategies.

Code under test: written against ``nixl._api`` and ``torch.distributed`` only, so it runs unchanged on the fakes
and on real NIXL.  The strategies differ in where their agent comes from, how they load peers and what their
``__del__`` releases; they share everything below:

- construction checks (contiguous tensors on one device) and the transfer state, set before anything can raise so
  that ``__del__`` always finds it;
- remote setup, deferred to the first ``set_transfer_context`` because the group is stateless (elastic EP): peers'
  agent metadata (:meth:`NixlReadCommunicator._load_peers`, which a strategy may override), then every rank's
  per-(layer, tensor) base address and bytes per expert, checked against this rank's;
- receiver-initiated READs: ``add_send`` does nothing, ``add_recv`` posts one READ per received expert (a descriptor
  per weight tensor of the layer), ``execute`` polls them to DONE, runs a barrier (an all_reduce, as vLLM does on
  stateless groups) and releases every handle.

This module keeps no state of its own; a strategy's module-level state stays per simulated process.
"""

from __future__ import annotations

import contextlib
import operator
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from sim.eplb.communicators.base import EplbCommunicator

if TYPE_CHECKING:
    import numpy as np

INIT_AGENT = "NIXL_INIT_AGENT"


def mem_type(tensor: Any) -> str:
    return "VRAM" if tensor.is_cuda else "DRAM"


def device_index(tensor: Any) -> int:
    return max(tensor.get_device(), 0)


def as_name(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


class NixlReadCommunicator(EplbCommunicator):
    """The shared part; a subclass sets ``self.nixl_wrapper`` in its constructor after calling this one."""

    nixl_wrapper: Any

    def __init__(self, group: Any, expert_weights: Sequence[Sequence[Any]], expert_buffer: Sequence[Any]) -> None:
        self._group = group
        self._rank = group.rank()
        self._world = group.size()
        self._expert_weights = [list(layer) for layer in expert_weights]
        self._expert_buffer = list(expert_buffer)
        if not self._expert_weights or not self._expert_weights[0]:
            raise ValueError("expert_weights must hold at least one layer with one tensor")
        self._num_local_experts = int(self._expert_weights[0][0].shape[0])
        tensors = self._tensors()
        device = tensors[0].device
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError("NIXL EPLB communicator needs contiguous expert weights and expert_buffer")
            if t.device != device:
                raise ValueError(f"expert tensors span devices ({device} and {t.device})")
        self._mem = mem_type(tensors[0])

        # Transfer state; set before anything that can raise, so that __del__ always finds it.
        self._xfer_handles: list[Any] = []  # posted READs not yet completed by execute()
        self._made_xfers: list[Any] = []  # every xfer handle made since the last execute(), to release
        self._made_dlists: list[Any] = []  # every prepared dlist handle made since the last execute()
        self._remote_agents: dict[int, str] = {}  # rank -> agent name
        self._remote_agent_ranks: dict[str, int] = {}  # agent name -> rank
        self._remote_send_meta: dict[int, dict[tuple[int, int], tuple[int, int, int]]] = {}
        self._remote_ready = False
        self._layer_idx: int | None = None
        self._old_indices: list[int] = []
        self._meta_flat: dict[int, tuple[tuple[int, int, int], ...]] = {}  # see _peer_meta
        self._meta_keys: list[tuple[int, int]] = []  # (layer, tensor), in order
        self._layer_slices: list[slice] = []  # each layer's entries in _meta_keys

    def _tensors(self) -> list[Any]:
        """Every tensor the communicator registers: each layer's expert weights, then ``expert_buffer``."""
        return [t for layer in self._expert_weights for t in layer] + self._expert_buffer

    # -- remote setup -----------------------------------------------------------------------------------------
    def _load_peers(self) -> list[str]:
        """Every rank's agent name, loading the others' metadata (``add_remote_agent`` for every peer)."""
        agent = self.nixl_wrapper
        gathered: list[Any] = [None] * self._world
        dist.all_gather_object(gathered, agent.get_agent_metadata(), group=self._group)
        return [
            agent.name if r == self._rank else as_name(agent.add_remote_agent(metadata))
            for r, metadata in enumerate(gathered)
        ]

    def _init_remote_state(self) -> None:
        names: dict[int, str] = {}
        ranks: dict[str, int] = {}
        for r, name in enumerate(self._load_peers()):
            if name in ranks:
                raise RuntimeError(f"NIXL agent name {name!r} is not unique (ranks {ranks[name]} and {r})")
            names[r], ranks[name] = name, r
        self._remote_agents, self._remote_agent_ranks = names, ranks

        mine = self._send_meta()
        metas: list[Any] = [None] * self._world
        dist.all_gather_object(metas, mine, group=self._group)
        # Every rank checks every peer's (layer, tensor) entries: R^2 x layers x tensors at each reconfiguration
        # (a quarter of a million per rank at EP64), so the common case is one C-level pass per peer: the strides
        # in the peer's order, which is this rank's when the keys match (every rank builds them the same way).
        stride_of = operator.itemgetter(1)
        strides = list(map(stride_of, mine.values()))
        per_rank: dict[int, dict[tuple[int, int], tuple[int, int, int]]] = {}
        for r, meta in enumerate(metas):
            if meta.keys() != mine.keys():
                raise RuntimeError(
                    f"rank {r} registered expert tensors {sorted(meta)}, rank {self._rank} "
                    f"{sorted(mine)}: layers and tensors must match on every rank"
                )
            if list(map(stride_of, meta.values())) != strides:
                bad = next(((k, v) for k, v in meta.items() if v[1] != mine[k][1]), None)
                if bad is not None:
                    raise RuntimeError(
                        f"layer {bad[0][0]} tensor {bad[0][1]}: rank {r} has {bad[1][1]} bytes per "
                        f"expert, rank {self._rank} {mine[bad[0]][1]}"
                    )
            # This rank's own copy from the collective (and tuples, as sent): kept as it is.
            per_rank[r] = meta
        self._remote_send_meta = per_rank
        self._meta_keys = list(mine)
        self._layer_slices, start = [], 0
        for tensors in self._expert_weights:
            self._layer_slices.append(slice(start, start + len(tensors)))
            start += len(tensors)
        self._meta_flat = {}
        self._remote_ready = True

    def _send_meta(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        meta = {}
        for layer, tensors in enumerate(self._expert_weights):
            for t, tensor in enumerate(tensors):
                nbytes = tensor.numel() * tensor.element_size()
                if nbytes % self._num_local_experts:
                    raise ValueError(
                        f"layer {layer} tensor {t}: {nbytes} bytes do not split into {self._num_local_experts} experts"
                    )
                meta[(layer, t)] = (tensor.data_ptr(), nbytes // self._num_local_experts, device_index(tensor))
        return meta

    # -- the communicator interface -----------------------------------------------------------------------
    def set_transfer_context(self, old_indices: np.ndarray | Sequence[int], layer_idx: int) -> None:
        if not self._remote_ready:
            self._init_remote_state()
        assert not self._xfer_handles, "set_transfer_context with transfers still pending"
        if getattr(torch.version, "hip", None):
            # vLLM 0.33.0's ROCm branch: NIXL READs bypass device streams, so wait for the copies still queued out
            # of the receive buffer before this layer's READs overwrite it (its CUDA path does not).
            torch.cuda.current_stream().synchronize()
        self._old_indices = old_indices.tolist() if hasattr(old_indices, "tolist") else list(old_indices)
        self._layer_idx = int(layer_idx)

    def _src_row(self, src_rank: int, expert_id: int) -> int | None:
        """The first row of ``src_rank`` that held ``expert_id`` before this layer's move (None: no row did)."""
        expert_id, n = int(expert_id), self._num_local_experts
        if expert_id < 0 or not 0 <= src_rank < self._world:  # -1 marks an empty row, not an expert
            return None
        lo = src_rank * n
        try:
            return self._old_indices.index(expert_id, lo, lo + n) - lo  # one C-level scan of the rank's rows
        except ValueError:
            return None

    def _peer_meta(self, src_rank: int) -> tuple[tuple[int, int, int], ...]:
        """``src_rank``'s (base address, bytes per expert, device) of every weight tensor, in this rank's (layer,
        tensor) order (:attr:`_layer_slices` cuts out a layer's): one flat tuple per peer, made on the first READ
        from it and serving every later one (one object, not a list per layer, for the collector to traverse)."""
        found = self._meta_flat.get(src_rank)
        if found is None:
            meta = self._remote_send_meta[src_rank]
            found = self._meta_flat[src_rank] = tuple([meta[key] for key in self._meta_keys])
        return found

    def add_send(self, tensors: Sequence[Any], dst_rank: int, expert_id: int) -> None:
        """Nothing to do: the receiver READs."""

    def add_recv(self, tensors: Sequence[Any], src_rank: int, expert_id: int) -> None:
        if self._layer_idx is None:
            raise RuntimeError("add_recv before set_transfer_context")
        layer = self._layer_idx
        row = self._src_row(src_rank, expert_id)
        if row is None:
            raise RuntimeError(f"expert {expert_id} is not on rank {src_rank} in layer {layer}")
        if src_rank == self._rank:
            for t, dst in enumerate(tensors):
                dst.copy_(self._expert_weights[layer][t][row])
            return
        metas = self._peer_meta(src_rank)[self._layer_slices[layer]]
        if len(tensors) > len(metas):
            raise RuntimeError(f"{len(tensors)} recv tensors for layer {layer}, which has {len(metas)} weight tensors")
        agent, remote_name = self.nixl_wrapper, self._remote_agents[src_rank]
        # One READ per received expert: a descriptor per weight tensor of the layer, all in one request.
        remote_descs = []
        for t, (dst, (base, stride, dev)) in enumerate(zip(tensors, metas)):
            assert dst.is_contiguous() and dst.nbytes == stride, (
                f"recv tensor {t} has {dst.nbytes} bytes, one expert has {stride}"
            )
            remote_descs.append((base + row * stride, stride, dev))
        local = agent.get_xfer_descs(list(tensors), self._mem)
        remote = agent.get_xfer_descs(remote_descs, self._mem)
        local_h = agent.prep_xfer_dlist(INIT_AGENT, local, self._mem)
        self._made_dlists.append(local_h)
        remote_h = agent.prep_xfer_dlist(remote_name, remote, self._mem)
        self._made_dlists.append(remote_h)
        indices = list(range(len(remote_descs)))
        xfer = agent.make_prepped_xfer("READ", local_h, indices, remote_h, indices)
        self._made_xfers.append(xfer)
        state = agent.transfer(xfer)
        if state not in ("PROC", "DONE"):
            raise RuntimeError(f"READ of expert {expert_id} from rank {src_rank}: transfer state {state}")
        self._xfer_handles.append(xfer)

    def execute(self) -> None:
        agent = self.nixl_wrapper
        for xfer in self._xfer_handles:
            while True:
                state = agent.check_xfer_state(xfer)
                if state == "DONE":
                    break
                if state != "PROC":
                    raise RuntimeError(f"EPLB READ failed: transfer state {state}")
        dist.all_reduce(torch.zeros(1), group=self._group)
        self._xfer_handles = []
        self._release_handles()

    # -- teardown -------------------------------------------------------------------------------------------
    def _release_handles(self, quiet: bool = False) -> None:
        """Release every xfer handle, then the dlists they were made from; ``quiet`` (teardown) swallows errors."""
        xfers, self._made_xfers = self._made_xfers, []
        dlists, self._made_dlists = self._made_dlists, []
        agent = self.nixl_wrapper
        if not quiet:
            for handle in xfers:
                agent.release_xfer_handle(handle)
            for handle in dlists:
                agent.release_dlist_handle(handle)
            return
        for release, handles in ((agent.release_xfer_handle, xfers), (agent.release_dlist_handle, dlists)):
            for handle in handles:
                with contextlib.suppress(Exception):
                    release(handle)
