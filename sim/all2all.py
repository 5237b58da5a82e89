"""vLLM's DeepEP all2all managers in the simulated workers: buffers made lazily per group, held and dropped as
vLLM holds and drops them, and one MoE forward through them per serving chunk, checked against a reference.

What vLLM does (reference ``deep_ep.md``, "vLLM managers" and "vLLM Elastic EP"), and what the worker does here:

- a manager's ``Cache`` is a weak-value dictionary keyed by the buffer's arguments, the group among them, so a new
  EP group means a new Buffer: made with the MoE kernels that hold it under vLLM 0.33.0 (at model load, and at
  PREPARE for the new group), on the first forward step on the group under pr-53947 (``Worker._buffers_made_ahead``);
- strong references: each MoE layer's prepare-and-finalize object (here ``Worker.a2a_buffer``, dropped at the
  switch) and, for low latency, the class attribute ``DeepEPLLAll2AllManager._buffer`` (here one per process,
  replaced when the next LL buffer is made);
- both managers pass ``explicitly_destroy=True``; ``destroy()`` destroys every buffer still in the cache; elastic EP
  runs the retired groups' ``destroy()`` on a background thread after the switch, while the new group serves.

The forward step uses its own small expert set (two experts per rank, four tokens of bf16): the point is the
collective calls and their order, not EPLB's experts.  The shapes are ones a real DeepEP takes: bf16 rows (its
combine kernels are built for bf16 alone), and for low latency a hidden size its kernels are built for.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

HIDDEN = 128  # high throughput: any row of whole 16-byte units
HIDDEN_LL = 2048  # low latency: the smallest size the kernels are built for
TOKENS = 4
TOPK = 2
MAX_TOKENS = 8  # num_max_dispatch_tokens_per_rank of the low-latency path
EXPERTS_PER_RANK = 2


def expert(e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of the check: an affine map that differs per expert, so a token sent to the wrong one shows."""
    return x * (e + 1) + e


def reference(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The MoE layer in one process: each token through its top-k experts, weighted (-1: an unused slot)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                out[t] += w[t, k] * expert(e, x[t])
    return out


def local_experts(recv_x: torch.Tensor, recv_idx: torch.Tensor, recv_w: torch.Tensor, rank: int,
                  per: int) -> torch.Tensor:
    """One rank's share after a high-throughput dispatch: each received token through its local experts,
    weighted (recv_idx holds local expert ids, -1 for experts elsewhere); summed in float32, returned in the rows'
    dtype, as an expert kernel accumulates."""
    y = torch.zeros(recv_x.shape, dtype=torch.float32)
    for i in range(recv_x.shape[0]):
        for k in range(recv_idx.shape[1]):
            le = int(recv_idx[i, k])
            if le >= 0:
                y[i] += recv_w[i, k] * expert(rank * per + le, recv_x[i].float())
    return y.to(recv_x.dtype)


def matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    """``got`` (bf16 rows moved and summed by DeepEP) equals the float32 reference to bf16 precision: each element
    within 2% of its row's largest value (an expert's output is rounded at its own magnitude before the sum)."""
    got = got.detach().float().cpu()
    if got.shape != want.shape:
        return False
    scale = want.abs().amax(dim=-1, keepdim=True)
    return bool(((got - want).abs() <= 0.02 * scale + 0.05).all())


class DeepEPAll2AllManager:
    """One group's manager (vLLM's ``DeepEP{HT,LL}All2AllManager``), in one simulated process."""

    def __init__(self, group: Any, low_latency: bool, explicitly_destroy: bool, process: "ProcessState") -> None:
        self.group, self.low_latency, self.explicitly_destroy = group, low_latency, explicitly_destroy
        self.process = process
        self.cache: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def _kwargs(self) -> dict[str, Any]:
        import deep_ep

        n = self.group.size()
        experts = EXPERTS_PER_RANK * n
        if self.low_latency:
            hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN_LL, n, experts)
            return {"group": self.group, "num_rdma_bytes": hint, "low_latency_mode": True,
                    "num_qps_per_rank": EXPERTS_PER_RANK, "explicitly_destroy": self.explicitly_destroy}
        return {"group": self.group, "num_nvl_bytes": 1 << 20, "explicitly_destroy": self.explicitly_destroy}

    def get_handle(self) -> Any:
        import deep_ep

        kwargs = self._kwargs()
        key = tuple(sorted((k, id(v) if k == "group" else v) for k, v in kwargs.items()))
        buf = self.cache.get(key)
        if buf is None:
            buf = deep_ep.Buffer(**kwargs)
            self.cache[key] = buf
            if self.low_latency:
                self.process.ll_buffer = buf  # the class attribute: the previous LL buffer loses this reference
        return buf

    def destroy(self) -> int:
        """``destroy()`` of every buffer still in the cache (collective), then the cache emptied, as vLLM's manager
        does; the number destroyed.  A buffer destroyed elsewhere first raises here, as DeepEP's does.  With
        ``explicitly_destroy`` off (managers from before vLLM passed it) nothing is destroyed: the buffers are
        left to their destructors."""
        done = 0
        if self.explicitly_destroy:
            for buf in list(self.cache.values()):
                buf.destroy()
                done += 1
        self.cache.clear()
        return done


class ProcessState:
    """What vLLM keeps per process across managers: the LL class attribute ``_buffer``."""

    def __init__(self) -> None:
        self.ll_buffer: Any = None


def forward(buf: Any, rank: int, n: int, gen: torch.Generator, *, extra_dispatch: bool = False,
            stale_handle: Any = None, device: str = "cpu") -> tuple[str | None, Any]:
    """One MoE layer's dispatch, local experts and combine through ``buf``: (a description of the first wrong token,
    or None when the result equals the single-process reference; the dispatch's handle).

    Faults: ``extra_dispatch`` runs one more low-latency dispatch first on this rank alone (a dummy batch: its
    double-buffer parity is then one ahead of its peers'); ``stale_handle`` is combined with instead of the new one
    (a handle kept from before the EP size changed).  ``device``: where the buffer's tensors live (a real DeepEP's
    GPU; the tokens are drawn on the host either way, so both worlds route the same ones)."""
    experts = EXPERTS_PER_RANK * n
    x = torch.randn(TOKENS, HIDDEN_LL if buf.low_latency_mode else HIDDEN, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:TOPK] for _ in range(TOKENS)])
    w = torch.rand(TOKENS, TOPK, generator=gen)
    xd, idxd, wd = x.to(device), idx.to(device), w.to(device)
    if buf.low_latency_mode:
        if extra_dispatch:
            buf.low_latency_dispatch(xd, idxd, MAX_TOKENS, experts, use_fp8=False)
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(xd, idxd, MAX_TOKENS, experts, use_fp8=False)
        recv_x, count = recv_x.cpu(), count.cpu()
        y = torch.zeros_like(recv_x)
        for le in range(EXPERTS_PER_RANK):
            c = int(count[le])
            y[le, :c] = expert(rank * EXPERTS_PER_RANK + le, recv_x[le, :c].float()).to(y.dtype)
        combined, _, _ = buf.low_latency_combine(y.to(device), idxd, wd,
                                                 handle if stale_handle is None else stale_handle)
    else:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxd, experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            xd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idxd, topk_weights=wd)
        y = local_experts(recv_x.cpu(), recv_idx.cpu(), recv_w.cpu(), rank, EXPERTS_PER_RANK)
        combined, _, _ = buf.combine(y.to(device), handle if stale_handle is None else stale_handle)
    want = reference(x.float(), idx, w)
    combined = combined.float().cpu()
    if matches(combined, want):
        return None, handle
    t = int((combined - want).abs().sum(dim=1).argmax())
    return f"token {t}: combined {combined[t, :2].tolist()} != reference {want[t, :2].tolist()}", handle
