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

import os
import weakref
from typing import Any, Callable

import torch

from fakes.deep_ep.reference import expert, local_experts, matches, reference

HIDDEN = 128  # high throughput: any row of whole 16-byte units
HIDDEN_LL = 2048  # low latency: the smallest size the kernels are built for
TOKENS = 4
TOPK = 2
MAX_TOKENS = 8  # num_max_dispatch_tokens_per_rank of the low-latency path
EXPERTS_PER_RANK = 2


def nvl_bytes() -> int:
    """The NVLink buffer of a high-throughput manager, as vLLM sizes it: ``VLLM_DEEPEP_BUFFER_SIZE_MB`` (1024 by
    default) MiB.  DeepEP's intranode dispatch refuses a buffer its queues do not fit (at 4 ranks and the default
    config, 10 channels x 4 ranks x 256 tokens of every row): a 1 MiB buffer of 128-wide bf16 rows asserts."""
    return int(os.environ.get("VLLM_DEEPEP_BUFFER_SIZE_MB", "1024")) * 1024 * 1024


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
            return {
                "group": self.group,
                "num_rdma_bytes": hint,
                "low_latency_mode": True,
                "num_qps_per_rank": EXPERTS_PER_RANK,
                "explicitly_destroy": self.explicitly_destroy,
            }
        return {"group": self.group, "num_nvl_bytes": nvl_bytes(), "explicitly_destroy": self.explicitly_destroy}

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


def manager_for(cfg: Any, group: Any, worker: Any) -> DeepEPAll2AllManager | None:
    """The manager a worker (simulated or real) makes for ``group``'s generation, None without an all2all backend;
    ``worker.a2a_process`` (vLLM's per-process state) is made on first use."""
    if cfg.backend == "none":
        return None
    if worker.a2a_process is None:
        worker.a2a_process = ProcessState()
    return DeepEPAll2AllManager(group, cfg.backend == "deepep_low_latency", cfg.explicitly_destroy, worker.a2a_process)


def switch(worker: Any, drop: Callable[[Any, str], None]) -> DeepEPAll2AllManager:
    """COMMIT (vLLM's ``_commit_staged_moe_quant_methods``): the new group's manager serves from now on, the staged
    kernels and the buffer they hold replace the MoE layer's, whose old buffer is dropped (``drop(obj, what)``; the
    last reference goes right after it); returns the retired manager."""
    retired, worker.a2a, worker.prepared_a2a = worker.a2a, worker.prepared_a2a, None
    old_buf, worker.a2a_buffer, worker.prepared_a2a_buffer = worker.a2a_buffer, worker.prepared_a2a_buffer, None
    if old_buf is not None:
        drop(old_buf, "old all2all buffer")
    del old_buf
    return retired


def retire_managers(worker: Any) -> list[DeepEPAll2AllManager]:
    """The worker's managers (the current group's, and a standby one), which it no longer holds: to be destroyed."""
    managers = [m for m in (worker.a2a, worker.prepared_a2a) if m is not None]
    worker.a2a = worker.prepared_a2a = None
    return managers


def shut_down(worker: Any, drop: Callable[[Any, str], None]) -> None:
    """Shutdown destroys the groups (standby ones too), and with them their buffers; then the buffers the MoE layer
    and the staged kernels held are dropped."""
    managers = retire_managers(worker)
    worker.history("all2all.cleanup", destroyed=sum(m.destroy() for m in managers))
    del managers
    for name in ("a2a_buffer", "prepared_a2a_buffer"):
        buf = getattr(worker, name)
        setattr(worker, name, None)
        if buf is not None:
            drop(buf, "all2all buffer at exit")
        del buf


def forward(
    buf: Any,
    rank: int,
    n: int,
    gen: torch.Generator,
    *,
    extra_dispatch: bool = False,
    stale_handle: Any = None,
    device: str = "cpu",
) -> tuple[str | None, Any]:
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
        combined, _, _ = buf.low_latency_combine(
            y.to(device), idxd, wd, handle if stale_handle is None else stale_handle
        )
    else:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxd, experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            xd,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=idxd,
            topk_weights=wd,
        )
        y = local_experts(recv_x.cpu(), recv_idx.cpu(), recv_w.cpu(), rank, EXPERTS_PER_RANK)
        combined, _, _ = buf.combine(y.to(device), handle if stale_handle is None else stale_handle)
    want = reference(x.float(), idx, w)
    combined = combined.float().cpu()
    if matches(combined, want):
        return None, handle
    t = int((combined - want).abs().sum(dim=1).argmax())
    return f"token {t}: combined {combined[t, :2].tolist()} != reference {want[t, :2].tolist()}", handle
