"""A small NIXL client shaped like vLLM's ``NixlEplbCommunicator`` (receiver-initiated READ), for conformance tests.

It is written against the public ``nixl._api`` surface only, and imports that module inside the constructor, so
the same class runs on the real NIXL wheel or on epsim's fake, depending on what ``nixl._api`` is at that moment.

What it keeps from vLLM's flow:

* one agent per reader, named ``eplb-{rank}-{uuid8}``; every expert tensor of every layer plus the expert buffer
  registered with one ``get_reg_descs`` + one ``register_memory`` call;
* out-of-band exchange of agent metadata and of per-(layer, tensor) ``(base_ptr, bytes_per_expert, dev)`` triples;
* ``add_send`` does nothing: the receiver posts a READ from the owner's expert row as soon as ``add_recv`` is
  called, and ``execute`` polls every posted request to DONE, then releases the handles;
* ``close`` is what vLLM's ``__del__`` does: release handles, deregister, remove every peer.

The collectives vLLM uses (``all_gather_object`` for the exchange, a barrier after ``execute``) are left to the
caller, which in a one-process test simply calls the readers in order.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

SendMeta = dict[tuple[int, int], tuple[int, int, int]]


class EplbReader:
    def __init__(
        self,
        rank: int,
        world_size: int,
        expert_weights: Sequence[Sequence[Any]],
        expert_buffer: Sequence[Any],
        *,
        poll_timeout_s: float = 30.0,
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config  # resolved now: the real wheel or the fake

        if not expert_weights or not expert_weights[0]:
            raise ValueError("expert_weights needs at least one layer with one tensor")
        self.rank = rank
        self.world_size = world_size
        self.expert_weights = [list(layer) for layer in expert_weights]
        self.expert_buffer = list(expert_buffer)
        self.num_local_experts = int(self.expert_weights[0][0].shape[0])
        self.poll_timeout_s = poll_timeout_s

        tensors = [t for layer in self.expert_weights for t in layer] + self.expert_buffer
        device = tensors[0].device
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError("every expert tensor and buffer must be contiguous")
            if t.device != device:
                raise ValueError("every expert tensor and buffer must be on one device")
        for layer in self.expert_weights:
            for t in layer:
                if int(t.shape[0]) != self.num_local_experts:
                    raise ValueError("every expert tensor needs num_local_experts rows")

        self.name = f"eplb-{rank}-{uuid.uuid4().hex[:8]}"
        self.agent = nixl_agent(self.name, nixl_agent_config(capture_telemetry=False))
        self._reg_descs = self.agent.get_reg_descs(tensors)
        self.agent.register_memory(self._reg_descs)

        self._remote_agents: dict[int, str] = {}  # rank -> agent name
        self._remote_ranks: dict[str, int] = {}  # agent name -> rank
        self._remote_send_meta: dict[int, SendMeta] = {}
        self._src_rows: dict[int, dict[int, int]] = {}  # rank -> expert id -> row in that rank's tensors
        self._layer: int | None = None
        self._pending: list[Any] = []  # xfer handles posted since the last execute()
        self._dlists: list[Any] = []  # prepped dlist handles those transfers were made from
        self._closed = False

    # -- out-of-band exchange ----------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def send_meta(self) -> SendMeta:
        meta: SendMeta = {}
        for layer_idx, layer in enumerate(self.expert_weights):
            for tensor_idx, t in enumerate(layer):
                nbytes = t.numel() * t.element_size()
                meta[(layer_idx, tensor_idx)] = (t.data_ptr(), nbytes // self.num_local_experts, max(t.get_device(), 0))
        return meta

    def connect(self, peer_metadatas: Sequence[bytes], peer_send_metas: Sequence[SendMeta]) -> None:
        """Load every other rank's agent; both sequences are indexed by rank (own entry ignored)."""
        if len(peer_metadatas) != self.world_size or len(peer_send_metas) != self.world_size:
            raise ValueError("need one metadata blob and one send meta per rank")
        own = self.send_meta()
        for peer_rank in range(self.world_size):
            if peer_rank == self.rank:
                continue
            meta = peer_send_metas[peer_rank]
            if set(meta) != set(own):
                raise ValueError(f"rank {peer_rank} exposes different (layer, tensor) keys")
            for key, (_, stride, _) in meta.items():
                if stride != own[key][1]:
                    raise ValueError(f"rank {peer_rank} has a different per-expert size for {key}")
            name = self.agent.add_remote_agent(peer_metadatas[peer_rank])
            name = name.decode() if isinstance(name, (bytes, bytearray)) else str(name)
            if name in self._remote_ranks:
                raise ValueError(f"remote agent name {name!r} is not unique")
            self._remote_agents[peer_rank] = name
            self._remote_ranks[name] = peer_rank
            self._remote_send_meta[peer_rank] = dict(meta)

    # -- data path ---------------------------------------------------------------------------------------------
    def set_transfer_context(self, old_indices: Sequence[int] | torch.Tensor, layer_idx: int) -> None:
        """``old_indices``: logical expert id per physical slot of this layer before the rebalance (-1: empty)."""
        if self._pending:
            raise RuntimeError("set_transfer_context() while transfers are still pending; call execute() first")
        ids = [int(x) for x in (old_indices.tolist() if hasattr(old_indices, "tolist") else old_indices)]
        if len(ids) != self.world_size * self.num_local_experts:
            raise ValueError(f"old_indices needs {self.world_size * self.num_local_experts} slots, got {len(ids)}")
        self._layer = layer_idx
        self._src_rows = {}
        for r in range(self.world_size):
            rows: dict[int, int] = {}
            for row in range(self.num_local_experts):
                expert = ids[r * self.num_local_experts + row]
                if expert != -1:
                    rows[expert] = row
            self._src_rows[r] = rows

    def add_send(self, tensors: Sequence[Any], dst_rank: int, expert_id: int) -> None:
        """Nothing to do: the receiving rank reads."""

    def add_recv(self, tensors: Sequence[Any], src_rank: int, expert_id: int) -> None:
        if self._layer is None:
            raise RuntimeError("add_recv() before set_transfer_context()")
        if src_rank not in self._remote_agents:
            raise KeyError(f"rank {src_rank} is not a connected peer of rank {self.rank}")
        src_row = self._src_rows[src_rank].get(expert_id)
        if src_row is None:
            raise KeyError(f"expert {expert_id} is not on rank {src_rank} in layer {self._layer}")
        meta = self._remote_send_meta[src_rank]
        remote = []
        for tensor_idx, t in enumerate(tensors):
            base, stride, dev = meta[(self._layer, tensor_idx)]
            nbytes = t.numel() * t.element_size()
            if nbytes != stride:
                raise ValueError(f"receive tensor {tensor_idx} has {nbytes} bytes, the expert row has {stride}")
            remote.append((base + src_row * stride, stride, dev))
        mem_type = "DRAM" if tensors[0].get_device() == -1 else "VRAM"

        local_descs = self.agent.get_xfer_descs(list(tensors))
        remote_descs = self.agent.get_xfer_descs(remote, mem_type)
        local_h = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs)
        self._dlists.append(local_h)
        remote_h = self.agent.prep_xfer_dlist(self._remote_agents[src_rank], remote_descs)
        self._dlists.append(remote_h)
        idx = list(range(len(remote)))
        xfer = self.agent.make_prepped_xfer("READ", local_h, idx, remote_h, idx)
        self._pending.append(xfer)
        state = self.agent.transfer(xfer)
        if state not in ("PROC", "DONE"):
            raise RuntimeError(f"posting the READ of expert {expert_id} from rank {src_rank} gave {state}")

    def execute(self) -> None:
        try:
            deadline = time.monotonic() + self.poll_timeout_s
            for xfer in self._pending:
                while True:
                    state = self.agent.check_xfer_state(xfer)
                    if state == "DONE":
                        break
                    if state != "PROC":
                        raise RuntimeError(f"transfer {xfer!r} of rank {self.rank} ended in state {state}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank {self.rank}: transfers not done after {self.poll_timeout_s}s")
                    time.sleep(0)
        finally:
            self._release_handles()

    def _release_handles(self) -> None:
        errors = []
        for handle in self._pending + self._dlists:
            try:
                handle.release()
            except Exception as exc:  # keep releasing the others, report the first problem
                errors.append(exc)
        self._pending, self._dlists = [], []
        if errors:
            raise errors[0]

    # -- teardown ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release handles, deregister, remove every peer; then drop the agent (vLLM does this in __del__)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._release_handles()
        finally:
            self.agent.deregister_memory(self._reg_descs)
            for name in list(self._remote_ranks):
                self.agent.remove_remote_agent(name)
            self._remote_agents.clear()
            self._remote_ranks.clear()
            self._remote_send_meta.clear()
            self.agent = None
