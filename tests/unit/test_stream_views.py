"""sim/vllm/move_loop.py's stream views: vLLM's non_blocking row copies carried onto a process's stream."""

from __future__ import annotations

from typing import Callable

import torch

from sim.vllm.move_loop import StreamView, stream_views


class Recorder:
    """A stream that holds what is issued on it until told to run it."""

    def __init__(self) -> None:
        self.ops: list[tuple[Callable[[], object], str]] = []

    def submit(self, op: Callable[[], object], what: str) -> None:
        self.ops.append((op, what))

    def run(self) -> None:
        for op, _ in self.ops:
            op()
        self.ops.clear()


def test_a_non_blocking_row_copy_waits_on_the_stream_and_reads_the_source_when_it_runs() -> None:
    weights, buffer = torch.zeros(3, 2), torch.arange(6, dtype=torch.float32).reshape(3, 2)
    stream = Recorder()
    w, b = stream_views([weights, buffer], torch.device("cuda", 1), stream)
    assert isinstance(w[1], StreamView) and w[1].device == torch.device("cuda", 1) and w.is_cuda
    assert w[1].data_ptr() == weights[1].data_ptr()  # the same storage: NIXL reads and writes it in place
    w[1].copy_(b[2], non_blocking=True)
    assert weights[1].tolist() == [0.0, 0.0] and [what for _, what in stream.ops] == ["vLLM row copy"]
    buffer[2] = torch.tensor([40.0, 50.0])  # a READ lands in the buffer before the copy runs
    stream.run()
    assert weights[1].tolist() == [40.0, 50.0]


def test_blocking_copies_and_other_operations_are_the_host_tensors_own() -> None:
    weights = torch.zeros(2, 2)
    stream = Recorder()
    (w,) = stream_views([weights], torch.device("cuda", 0), stream)
    w[0].copy_(torch.ones(2))  # not non_blocking: at once, as on a GPU
    assert weights[0].tolist() == [1.0, 1.0] and not stream.ops
    total = w.sum()
    assert type(total) is torch.Tensor and float(total) == 2.0
    assert (w.nbytes, tuple(w.shape)) == (16, (2, 2))


def test_without_a_stream_a_copy_runs_when_issued() -> None:
    weights, src = torch.zeros(2), torch.ones(2)
    (w,) = stream_views([weights], torch.device("cuda", 0), None)
    w.copy_(src, non_blocking=True)
    assert weights.tolist() == [1.0, 1.0]
