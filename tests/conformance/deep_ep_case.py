"""One DeepEP case, written against the ``deep_ep.Buffer`` API only, run by the fake (simulated ranks) and by a real
DeepEP (one process per GPU): high-throughput dispatch, each rank's experts, combine, compared with a single-process
reference; then the destroy rules."""

from __future__ import annotations

from typing import Any

import torch

from sim.all2all import expert, local_experts, reference  # noqa: F401 - the reference lives with the sim's forward

HIDDEN, TOKENS, TOPK = 256, 8, 4


def inputs(n: int, experts: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(TOKENS, HIDDEN, generator=gen) for _ in range(n)]
    idxs = [torch.stack([torch.randperm(experts, generator=gen)[:TOPK] for _ in range(TOKENS)]) for _ in range(n)]
    ws = [torch.rand(TOKENS, TOPK, generator=gen) for _ in range(n)]
    return xs, idxs, ws


def run_case(buffer_cls: Any, group: Any, rank: int, n: int, device: str = "cpu") -> dict[str, Any]:
    """What one rank observes; every value is plain data so that processes can report it."""
    experts = 2 * n
    xs, idxs, ws = inputs(n, experts)
    x, idx, w = xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device)
    buf = buffer_cls(group, num_nvl_bytes=1 << 26, explicitly_destroy=True)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w)
    combined, _, _ = buf.combine(local_experts(recv_x, recv_idx, recv_w, rank, experts // n), handle)
    error = float((combined.cpu() - reference(xs[rank], idxs[rank], ws[rank])).abs().max())
    buf.destroy()
    after_destroy = None
    try:
        buf.get_dispatch_layout(idx, experts)
    except Exception as exc:  # noqa: BLE001 - the type is the observation
        after_destroy = type(exc).__name__
    unflagged = buffer_cls(group, num_nvl_bytes=1 << 26)
    try:
        unflagged.destroy()
        destroy_without_flag = None
    except Exception as exc:  # noqa: BLE001
        destroy_without_flag = type(exc).__name__
    return {"max_error": error, "counts": [int(c) for c in counts], "received": int(recv_x.shape[0]),
            "after_destroy": after_destroy, "destroy_without_flag": destroy_without_flag}
