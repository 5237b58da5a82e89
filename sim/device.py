"""Asynchronous device copies: each simulated process's current CUDA stream, as far as EPLB's row copies go.

vLLM moves expert rows through ``expert_buffer`` with ``non_blocking`` copies on the current CUDA stream (the local
copies into the buffer before a layer's transfers, ``move_from_buffer`` after them), while a NIXL READ is posted
from the CPU and lands whenever the NIC or NVLink delivers it, in no order with that stream.  If the stream is
behind, the next layer's READs can overwrite buffer rows before the previous layer's copies out of them have run,
and a layer's weights end up holding another layer's experts.  That was seen once on an H200 pair
(docs/validation.md); the zero-copy NIXL communicator of vLLM has no synchronization before it posts READs.

The simulated tensors live in host memory and their copies are synchronous, so by default a copy runs when it is
issued and nothing here changes a run.  The fault site ``device.stream_lag:delay_s=S`` puts ``S`` seconds of other
work on a process's stream in front of each copy of one rebalance, as a busy GPU would (and as the real backend
does on a GPU, with a sleep kernel before each copy): copies run in issue order, each ``S`` after the stream got to
it, and a READ completing in between sees the buffer as it was.  ``torch.cuda.current_stream()`` and
``torch.cuda.synchronize()`` are this model inside a run (:func:`installed`); a synchronization waits, in simulated
time, until the stream has run everything issued, so a strategy that synchronizes before posting its READs is
exercised as it would run on a GPU.  Readers ordered with the stream (the next forward step, and with it the
weight check after a rebalance) see every copy issued before them.  Without a fault, ``serving.host_ahead_steps``
leaves forward work queued on the stream after every serving step (:meth:`DeviceStream.backlog`), as a host that
runs ahead of its GPU does; copies issued then wait behind it.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from typing import Any, Callable, Iterator


class DeviceStream:
    """The current stream of one simulated process: copies run in issue order, each ``lag_s`` after the stream got
    to it."""

    def __init__(self, kernel, pid: int) -> None:
        self.kernel, self.pid = kernel, pid
        self.lag_s = 0.0
        self._queue: deque[tuple[int, Callable[[], None], str]] = deque()  # (issue number, op, what)
        self._issued = 0
        self._busy_until = 0.0  # when the stream will have run everything issued so far

    def __repr__(self) -> str:
        return f"<DeviceStream pid={self.pid} lag={self.lag_s:g} s pending={len(self._queue)}>"

    def backlog(self, seconds: float) -> None:
        """The host returned from launching forward work that keeps the stream busy ``seconds`` from now: a copy
        issued before then runs after it (the stream is in order)."""
        if seconds > 0.0:
            self._busy_until = max(self._busy_until, self.kernel.now() + seconds)

    def submit(self, op: Callable[[], None], what: str) -> None:
        """Issue ``op`` (a copy) on the stream: it runs now if the stream keeps up, else when its turn comes."""
        now = self.kernel.now()
        if self.lag_s <= 0.0 and not self._queue and self._busy_until <= now:
            op()
            return
        self._busy_until = max(now, self._busy_until) + self.lag_s
        self._issued += 1
        self._queue.append((self._issued, op, what))
        timer = self.kernel.env.timeout(self._busy_until - now)
        timer.callbacks.append(functools.partial(self._run_through, self._issued))

    def _run_through(self, issued: int, _event: Any) -> None:
        # The timer of copy number ``issued``: it runs that copy and any earlier one still queued.  A flush or a
        # synchronize may have run them already; then the timer finds only later copies, which are not yet due.
        while self._queue and self._queue[0][0] <= issued:
            self._queue.popleft()[1]()

    def query(self) -> bool:
        """``torch.cuda.Stream.query``: True when every issued copy has run."""
        return not self._queue

    def synchronize(self, reason: str = "synchronize") -> None:
        """``torch.cuda.Stream.synchronize``: the calling thread waits until the stream has run everything issued."""
        wait = self._busy_until - self.kernel.now()
        if not self._queue:
            if wait > 0 and self.kernel.current() is not None:  # forward work only: wait for it, record nothing
                self.kernel.sleep(wait, "stream synchronize (forward work)")
            return
        copies, first = len(self._queue), self._queue[0][2]
        if wait > 0 and self.kernel.current() is not None:
            self.kernel.sleep(wait, f"stream synchronize ({copies} copies)")
        self._drain("device.sync", reason, copies, first)

    def flush(self, reason: str) -> None:
        """What a reader ordered after the issued copies on the stream sees: they all run now (no one waits)."""
        if not self._queue:
            return
        self._drain("device.flush", reason, len(self._queue), self._queue[0][2])

    def _drain(self, kind: str, reason: str, copies: int, first: str) -> None:
        """Run every issued copy now, then record it (counted when the caller asked, before any wait)."""
        while self._queue:
            self._queue.popleft()[1]()
        self.kernel.history.record(kind, pid=self.pid, reason=reason, copies=copies, first=first)


def current(streams: dict[int, DeviceStream], kernel) -> DeviceStream | None:
    """The stream of the simulated process whose thread is running, if it has one."""
    thread = kernel.current()
    return streams.get(thread.pid) if thread is not None else None


# What ``torch.version.hip`` reads inside a run on a ROCm profile: the simulated ranks run on ROCm, and code under
# test that asks torch (vLLM's platform check, the built-in strategies) takes its ROCm path.
SIMULATED_HIP = "6.4.0 (simulated by epsim)"


@contextlib.contextmanager
def installed(streams: dict[int, DeviceStream], kernel, rocm: bool = False) -> Iterator[None]:
    """``torch.cuda.current_stream()`` and ``torch.cuda.synchronize()`` (and their ``torch.accelerator`` forms) answer
    with the running process's simulated stream while the block runs (code outside a simulated process gets torch's
    own); with ``rocm``, ``torch.version.hip`` says the ranks run on ROCm."""
    import torch
    import torch.cuda as cuda

    saved = cuda.current_stream, cuda.synchronize

    def current_stream(device: Any = None):
        stream = current(streams, kernel)
        return stream if stream is not None else saved[0](device)

    def synchronize(device: Any = None) -> None:
        stream = current(streams, kernel)
        if stream is None:
            saved[1](device)
        else:
            stream.synchronize("torch.cuda.synchronize")

    cuda.current_stream, cuda.synchronize = current_stream, synchronize
    saved_hip = torch.version.hip
    if rocm:
        torch.version.hip = SIMULATED_HIP
    # torch.accelerator is the device-neutral spelling (vLLM's ROCm path synchronises through it).
    accelerator = getattr(torch, "accelerator", None)
    saved_acc = (accelerator.current_stream, accelerator.synchronize) if accelerator is not None else None
    if accelerator is not None:
        accelerator.current_stream, accelerator.synchronize = current_stream, synchronize
    try:
        yield
    finally:
        torch.version.hip = saved_hip
        cuda.current_stream, cuda.synchronize = saved
        if accelerator is not None and saved_acc is not None:
            accelerator.current_stream, accelerator.synchronize = saved_acc
