"""vLLM's move loop, run unmodified for vLLM's own communicator (``--strategy vllm[...]``).

``vllm/distributed/eplb/rebalance_execute.py`` is what moves expert rows in vLLM: ``rearrange_expert_weights_inplace``
for a synchronous rebalance, and for async EPLB ``transfer_layer`` on the async thread (local copies into
``expert_buffer``, the communicator's transfer context, sends, recvs, ``execute``) and ``move_from_buffer`` on the
main thread.  Where the strategy is vLLM's code, the workers of both worlds call these functions, from the same
sources as the communicator, instead of epsim's model of them (``sim/eplb/move.py``); what stays epsim's is the
async worker's control flow around them (the coordinated stop, the stream synchronize, the consumed event:
``async_worker.py`` needs vLLM's ``EplbState`` and its config machinery, so it is modelled, not run).

vLLM issues every row copy as ``dst.copy_(src, non_blocking=True)`` on the current stream.  Its tensors are handed
over as :class:`StreamView`\\ s, which carry those copies onto the process's stream: the simulated
:class:`sim.device.DeviceStream` (so that they run in stream order, behind forward work, while READs land when
they complete), the real backend's lagging CUDA stream under ``device.stream_lag``, or, with no stream, the copy
itself (on a GPU a real ``non_blocking`` copy on the real current stream).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from .device import DeviceView, host

REBALANCE_MODULE = "vllm.distributed.eplb.rebalance_execute"


class StreamView(DeviceView):
    """A tensor whose ``non_blocking`` copies into it are issued on ``_epsim_stream`` (``submit(op, what)``), and
    whose row views are stream views too; every other operation gives plain tensors."""

    _epsim_stream: Any

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]  # torch's protocol
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and kwargs.get("non_blocking") and isinstance(args[0], StreamView):
            return _issue_copy(args[0], args[1])
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if func is torch.Tensor.__getitem__ and isinstance(args[0], StreamView):
            return _view(result, args[0]._epsim_device, args[0]._epsim_stream)
        return result


def _view(t: torch.Tensor, device: torch.device, stream: Any) -> StreamView:
    view = torch.Tensor.as_subclass(t, StreamView)
    view._epsim_device, view._epsim_stream = device, stream
    return view


def _issue_copy(dst: StreamView, src: Any) -> StreamView:
    into, source = host(dst), host(src)
    stream = dst._epsim_stream
    if stream is None:
        into.copy_(source, non_blocking=True)
    else:
        stream.submit(lambda: into.copy_(source, non_blocking=True), "vLLM row copy")
    return dst


def stream_views(tensors: Any, device: torch.device, stream: Any) -> Any:
    """``tensors`` (a tensor, or nested lists of them) as stream views: the same storage, ``device`` as their
    device where they live in host memory (vLLM's code insists on a GPU), copies issued on ``stream``."""
    if isinstance(tensors, torch.Tensor):
        plain = host(tensors)
        real = torch.Tensor.device.__get__(plain)
        return _view(plain, device if real.type == "cpu" else real, stream)
    return [stream_views(t, device, stream) for t in tensors]


def _indices(p2l: np.ndarray) -> torch.Tensor:
    """A placement's map as vLLM holds it: an int64 tensor of its own (the placement's array is read-only and
    shared; vLLM's code gets a copy it may write, as its ``.cpu()`` of a GPU tensor is)."""
    return torch.from_numpy(np.array(p2l, dtype=np.int64))


class VllmMoveLoop:
    """One process's ``rebalance_execute`` module and the device its views report."""

    def __init__(self, module: Any, device: torch.device) -> None:
        self.module, self.device = module, device

    def rearrange(
        self,
        old_p2l: np.ndarray,
        new_p2l: np.ndarray,
        weights: Sequence,
        buffer: Sequence,
        ep_group: Any,
        communicator: Any,
        rank_mapping: dict[int, int] | None,
        stream: Any,
    ) -> None:
        """``rearrange_expert_weights_inplace``: every layer, as a synchronous rebalance (and vLLM's elastic
        reshuffle) moves them."""
        self.module.rearrange_expert_weights_inplace(
            old_global_expert_indices=_indices(old_p2l),
            new_global_expert_indices=_indices(new_p2l),
            expert_weights=stream_views(weights, self.device, stream),
            expert_buffer=stream_views(buffer, self.device, stream),
            ep_group=ep_group,
            communicator=communicator,
            rank_mapping=rank_mapping,
        )

    def transfer_layer(
        self,
        layer: int,
        old_p2l: np.ndarray,
        new_p2l: np.ndarray,
        weights_layer: Sequence,
        buffer: Sequence,
        ep_group: Any,
        communicator: Any,
        rank_mapping: dict[int, int] | None,
        stream: Any,
    ) -> Any:
        """``transfer_layer`` for one layer, as vLLM's async thread calls it; returns its ``TransferMetadata``.
        (vLLM passes the async thread's own stream, which waits for the main stream's consumed event; one in-order
        stream per process stands for both, as in ``sim/worker.py``.)"""
        return self.module.transfer_layer(
            old_layer_indices=_indices(old_p2l[layer]),
            new_layer_indices=_indices(new_p2l[layer]),
            expert_weights=stream_views(weights_layer, self.device, stream),
            expert_weights_buffer=stream_views(buffer, self.device, stream),
            ep_group=ep_group,
            communicator=communicator,
            rank_mapping=rank_mapping,
            layer_idx=layer,
        )

    def move_from_buffer(
        self,
        layer: int,
        new_p2l: np.ndarray,
        metadata: Any,
        weights_layer: Sequence,
        buffer: Sequence,
        ep_rank: int,
        stream: Any,
    ) -> None:
        """``move_from_buffer`` for one layer, as vLLM's main thread calls it (``_move_to_workspace``)."""
        self.module.move_from_buffer(
            expert_weights=stream_views(weights_layer, self.device, stream),
            expert_weights_buffers=stream_views(buffer, self.device, stream),
            transfer_metadata=metadata,
            new_indices=np.array(new_p2l[layer]),
            ep_rank=ep_rank,
        )


def of(factory: Any) -> VllmMoveLoop | None:
    """vLLM's move loop for a strategy factory that is vLLM's code (``--strategy vllm[...]``), else None."""
    from .strategy import VllmProcess

    proc = getattr(factory, "__self__", None)
    return proc.move_loop() if isinstance(proc, VllmProcess) else None
