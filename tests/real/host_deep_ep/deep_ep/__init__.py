"""A test double named ``deep_ep`` for the real backend on CPU: a ``Buffer`` whose collectives are gloo calls on the
group it is given, so that the real rank's all2all lifecycle (buffers made at load and PREPARE, a forward per serving
command, the switch at COMMIT, the cleanup thread, destroy at exit, the leak warning on stdout) runs in CI without a
GPU. It is not DeepEP and claims nothing about it: the DeepEP catalogue (docs/deep-ep-fake.md) does that. A test puts
this folder on the rank processes' PYTHONPATH."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

WARNING = b"WARNING: destroy() was not called before DeepEP buffer destruction, which can leak resources.\n"


def _barrier(group: Any) -> None:
    dist.all_reduce(torch.zeros(1), group=group)


class Buffer:
    num_sms = 20

    def __init__(
        self,
        group: Any = None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        explicitly_destroy: bool = False,
        **_: Any,
    ) -> None:
        if low_latency_mode:
            raise NotImplementedError("the host double models the high-throughput buffer only")
        self.group, self.explicitly_destroy = group, explicitly_destroy
        self.low_latency_mode = False
        self.rank, self.group_size = group.rank(), group.size()  # as DeepEP's Python side asks the group
        self.runtime: Any = object()
        _barrier(group)  # the constructor's exchanges

    def _live(self) -> None:
        if self.runtime is None:  # as DeepEP's: the runtime is None after destroy()
            raise AttributeError("'NoneType' object has no attribute 'intranode_dispatch'")

    def get_dispatch_layout(self, topk_idx, num_experts, *_: Any, **__: Any):
        per = num_experts // self.group_size
        in_rank = torch.zeros(topk_idx.shape[0], self.group_size, dtype=torch.bool)
        for r in range(self.group_size):
            in_rank[:, r] = ((topk_idx >= r * per) & (topk_idx < (r + 1) * per)).any(dim=1)
        per_expert = torch.tensor([int((topk_idx == e).sum()) for e in range(num_experts)], dtype=torch.int32)
        return in_rank.sum(dim=0).to(torch.int32), None, per_expert, in_rank, None

    def dispatch(
        self,
        x,
        num_tokens_per_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        **_: Any,
    ):
        self._live()
        everyone: list[Any] = [None] * self.group_size
        dist.all_gather_object(everyone, (x, topk_idx, topk_weights), group=self.group)
        per = num_tokens_per_expert.numel() // self.group_size
        rows, idx, w, layout = [], [], [], []
        for sx, sidx, sw in everyone:
            mine = ((sidx >= self.rank * per) & (sidx < (self.rank + 1) * per)).any(dim=1).nonzero().flatten()
            layout.append(mine)
            rows.append(sx[mine])
            local = sidx[mine]
            inside = (local >= self.rank * per) & (local < (self.rank + 1) * per)
            idx.append(torch.where(inside, local - self.rank * per, torch.full_like(local, -1)))
            w.append(torch.where(inside, sw[mine], torch.zeros_like(sw[mine])))
        handle = (layout, [int(t.shape[0]) for t, _, _ in everyone])
        counts = [int((torch.cat(idx) == e).sum()) for e in range(per)]
        return torch.cat(rows), torch.cat(idx), torch.cat(w), counts, handle, None

    def combine(self, x, handle, **_: Any):
        self._live()
        layout, tokens = handle
        everyone: list[Any] = [None] * self.group_size
        dist.all_gather_object(everyone, (x, layout), group=self.group)
        out = torch.zeros((tokens[self.rank],) + tuple(x.shape[1:]), dtype=torch.float32)
        for rows, their_layout in everyone:
            start = 0
            for src, picked in enumerate(their_layout):
                n = int(picked.numel())
                if src == self.rank:
                    out.index_add_(0, picked, rows[start : start + n].float())
                start += n
        return out.to(x.dtype), None, None

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._live()
        self._destroy()

    def _destroy(self) -> None:
        _barrier(self.group)  # DeepEP's device barrier over the ranks
        self.runtime = None

    def __del__(self) -> None:
        if getattr(self, "runtime", None) is None:
            return
        if self.explicitly_destroy:
            os.write(1, WARNING)  # as DeepEP's printf: file descriptor 1, not Python's stdout
            return
        self._destroy()

    @staticmethod
    def get_low_latency_rdma_size_hint(*_: Any) -> int:
        raise NotImplementedError("the host double models the high-throughput buffer only")
