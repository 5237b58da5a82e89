"""Host memory standing in for the GPU memory vLLM's NIXL communicator insists on.

vLLM 0.33.0's factory refuses expert weights on the CPU ("supports only cuda-like devices"), and its communicator
registers them, and describes every READ, as ``VRAM`` on the weights' device.  epsim's simulated ranks (and its
real ranks on a CPU host) keep expert weights in host memory.  Two pieces let vLLM's code run there unmodified:

- :func:`on_device` gives the code under test *device views* of the host tensors: the same storage, reporting
  ``cuda:N`` as their device (``device``, ``is_cuda``, ``get_device()``); every other operation is the host
  tensor's own (they return plain tensors).
- :func:`host_memory_agent` wraps a NIXL ``nixl_agent`` class for worlds whose memory is host memory (real NIXL on
  a CPU host, the fake's ``dram`` and ``rdma`` profiles): ``VRAM`` descriptors become ``DRAM`` ones on device 0 on
  their way into NIXL, which is what the same bytes are there.  Where the world's NIXL takes device memory (the
  fake's ``cuda`` and ``rocm-strict`` profiles, real NIXL on a GPU) nothing is translated.
"""

from __future__ import annotations

from typing import Any

import torch


class DeviceView(torch.Tensor):
    """A host tensor that reports a GPU as its device; operations on it give plain host tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    _epsim_device: torch.device

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._epsim_device

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return self._epsim_device.type == "cuda"

    def get_device(self) -> int:
        return self._epsim_device.index if self._epsim_device.index is not None else 0


def device_view(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` as seen on ``device`` (``t`` itself if it is on a device already)."""
    if torch.Tensor.device.__get__(t).type != "cpu":
        return t
    view = torch.Tensor.as_subclass(t, DeviceView)
    view._epsim_device = device
    return view


def host(t: Any) -> Any:
    """The host tensor behind a device view (anything else as it is)."""
    return torch.Tensor.as_subclass(t, torch.Tensor) if isinstance(t, DeviceView) else t


class ViewCache:
    """Device views of a process's tensor lists, made once per list: vLLM's ``EplbState`` passes the same
    ``expert_weights`` and ``expert_buffer`` objects to every communicator it creates, and so does this."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lists: dict[int, tuple[Any, list]] = {}  # id(source list) -> (the list, its views)

    def views(self, tensors: Any) -> list:
        got = self._lists.get(id(tensors))
        if got is None or got[0] is not tensors:
            got = self._lists[id(tensors)] = (tensors, [self._view(t) for t in tensors])
        return got[1]

    def _view(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return device_view(t, self.device)
        return self.views(t)  # a layer's list of tensors


def _host_descs(descs: Any, mem_type: str | None) -> tuple[Any, str | None]:
    if mem_type is not None and str(mem_type).upper() in ("VRAM", "VRAM_SEG", "CUDA", "GPU"):
        mem_type = "DRAM"
    if isinstance(descs, list) and descs and isinstance(descs[0], torch.Tensor):
        return [host(t) for t in descs], mem_type
    if isinstance(descs, list) and descs and isinstance(descs[0], tuple):
        return [(d[0], d[1], 0, *d[3:]) for d in descs], mem_type
    return host(descs), mem_type


def host_memory_agent(agent_cls: type) -> type:
    """``agent_cls`` (a NIXL ``nixl_agent``) for a world whose memory is host memory: device descriptors become
    host descriptors on their way in."""

    class HostMemoryAgent(agent_cls):
        __doc__ = f"{agent_cls.__module__}.{agent_cls.__name__}, with device memory that lives in host memory."

        def _inherited(self, name: str) -> Any:
            # A wrapping agent class (the real backend's ledger) may forward these through __getattr__, which a
            # super() lookup does not consult.
            try:
                return getattr(super(HostMemoryAgent, self), name)
            except AttributeError:
                forward = getattr(agent_cls, "__getattr__", None)
                if forward is None:
                    raise
                return forward(self, name)

        def get_reg_descs(self, descs: Any, mem_type: str | None = None, *args: Any, **kwargs: Any):
            descs, mem_type = _host_descs(descs, mem_type)
            return self._inherited("get_reg_descs")(descs, mem_type, *args, **kwargs)

        def get_xfer_descs(self, descs: Any, mem_type: str | None = None, *args: Any, **kwargs: Any):
            descs, mem_type = _host_descs(descs, mem_type)
            return self._inherited("get_xfer_descs")(descs, mem_type, *args, **kwargs)

    HostMemoryAgent.__name__ = HostMemoryAgent.__qualname__ = agent_cls.__name__
    return HostMemoryAgent
