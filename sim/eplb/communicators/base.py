"""vLLM's EPLB communicator interface, and the factory signature every strategy implements.

A strategy module exposes ``create(group, expert_weights, expert_buffer, prev_communicator=None)`` returning an
:class:`EplbCommunicator`.  It is written against ``nixl._api`` and ``torch.distributed`` only, so the same module
runs in the simulation (fakes) and on real NIXL processes.  Module-level state (a registry, a cache) is
*per process*: the simulator loads a fresh instance of the module for every simulated process.

Arguments, as in vLLM:
- ``group``: the EPLB process group (``group.rank()``, ``group.size()``; pass it to torch.distributed calls).
- ``expert_weights``: ``[layer][tensor]`` contiguous tensors of shape ``[num_local_experts, ...]``.
- ``expert_buffer``: ``[tensor]`` tensors shaped like one layer's weights; received experts land here.
- ``prev_communicator``: the communicator this one replaces at an elastic reconfiguration (None at start-up).

Data path: ``set_transfer_context(old_indices, layer_idx)`` with ``old_indices`` the layer's global
physical-to-logical map *before* the move, an int64 ``numpy.ndarray`` as vLLM passes it (length
``group.size() * num_local_experts``; -1 for an empty slot; read-only: every rank is handed the same array);
``add_send(tensors, dst_rank, expert_id)`` and ``add_recv(tensors, src_rank, expert_id)`` for each expert that
moves (``tensors``: one row per weight tensor: the source rows for a send, the ``expert_buffer`` rows for a recv);
``execute()`` completes them all and returns when this rank's receives have landed and every rank is done.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol, Sequence

import numpy as np


class EplbCommunicator(ABC):
    def set_transfer_context(self, old_indices: np.ndarray, layer_idx: int) -> None:  # noqa: B027
        """Called before the sends and receives of one layer."""

    @abstractmethod
    def add_send(self, tensors: Sequence[Any], dst_rank: int, expert_id: int) -> None: ...

    @abstractmethod
    def add_recv(self, tensors: Sequence[Any], src_rank: int, expert_id: int) -> None: ...

    @abstractmethod
    def execute(self) -> None: ...


class CommunicatorFactory(Protocol):
    def __call__(
        self,
        group: Any,
        expert_weights: Sequence[Sequence[Any]],
        expert_buffer: Sequence[Any],
        prev_communicator: EplbCommunicator | None = None,
    ) -> EplbCommunicator: ...
