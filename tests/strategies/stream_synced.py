"""``shared-agent`` plus the stream synchronization vLLM's staged NIXL communicator had and the zero-copy one lacks.

vLLM's ``move_from_buffer`` copies ``expert_buffer`` into the weights with ``non_blocking=True``; a NIXL READ is
posted from the CPU and does not wait for the CUDA stream.  Without a synchronization the next layer's READs can
land in ``expert_buffer`` before the previous layer's copies out of it have run (seen on an H200 pair:
docs/validation.md).  This variant waits for the current stream before a layer's READs are posted.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from sim.eplb.communicators.shared_agent import SharedAgentNixlCommunicator


class StreamSyncedCommunicator(SharedAgentNixlCommunicator):
    def set_transfer_context(self, old_indices: np.ndarray | Sequence[int], layer_idx: int) -> None:
        _wait_for_copies(self._expert_buffer[0])
        super().set_transfer_context(old_indices, layer_idx)


def _wait_for_copies(buffer: Any) -> None:
    import torch

    if buffer.is_cuda:
        torch.cuda.current_stream(buffer.device).synchronize()
        return
    try:  # host memory: inside epsim's simulation this is the simulated process's stream (sim/device.py)
        stream = torch.cuda.current_stream()
    except (AssertionError, RuntimeError):  # a torch without CUDA: every copy already ran
        return
    stream.synchronize()


def create(group: Any, expert_weights, expert_buffer, prev_communicator=None) -> StreamSyncedCommunicator:
    return StreamSyncedCommunicator(group, expert_weights, expert_buffer, prev_communicator)
