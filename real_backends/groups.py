"""Stateless process groups for real rank processes: one gloo group per EP generation, as vLLM's elastic EP makes
(two under async EPLB: the communicator's EPLB group and, named ``<generation>/ep``, the EP group that the main
thread's per-step readiness all_reduce runs on; ``real_backends.rank`` opens both).

The default ``torch.distributed`` world cannot grow or shrink, so elastic EP builds each generation's group from a
key-value store of its own (vLLM's stateless groups).  Here the parent hosts one ``TCPStore``; a generation's group
is a ``ProcessGroup`` with a gloo backend over a ``PrefixStore`` named after the generation.  ``torch.distributed``
collectives take it as ``group=`` and ``group.rank()``/``group.size()`` answer, so the strategies run unchanged.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GroupSpec:
    """What a rank needs to join one generation's group (picklable; the parent sends it)."""

    name: str
    rank: int
    size: int


@dataclass
class RealGroup:
    """The parent's view of a generation: its member processes, in rank order."""

    name: str
    pids: list[int]
    destroyed: bool = field(default=False)

    def groups(self) -> list[GroupSpec]:
        return [GroupSpec(self.name, r, len(self.pids)) for r in range(len(self.pids))]


def connect_store(host: str, port: int, timeout_s: float):
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))


def open_group(store, spec: GroupSpec, timeout_s: float):
    """Join ``spec``'s group; blocks until every member has joined (gloo connects a full mesh)."""
    import torch
    import torch.distributed as dist

    prefixed = dist.PrefixStore(spec.name, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    group = dist.ProcessGroup(prefixed, spec.rank, spec.size)
    backend = dist.ProcessGroupGloo(prefixed, spec.rank, spec.size, timeout)
    backend._set_sequence_number_for_group()
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group
