"""The MoE layer a dispatch and combine through a DeepEP ``Buffer`` must reproduce, computed in one process: the
check of the simulated workers' forward (``sim/all2all.py``), of the fake's tests and of the DeepEP behaviour
catalogue, on the fake and on a real build alike."""

from __future__ import annotations

import torch


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


def local_experts(
    recv_x: torch.Tensor, recv_idx: torch.Tensor, recv_w: torch.Tensor, rank: int, per: int
) -> torch.Tensor:
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
