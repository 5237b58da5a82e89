"""The device side of one set of DeepEP buffers: what the ranks' buffers share after the constructor's IPC-handle
exchange, and the device barriers their collective calls meet at.

A real Buffer opens its peers' IPC handles and (for RDMA/LL) joins an NVSHMEM world; every rank's kernels then wait on
flags the others write.  Here the ranks' buffers share a :class:`Team`; a collective call is a meeting at the team's
next sequence number, matched by kind (and, for low-latency calls, by the double-buffer parity).  A rank that does not
arrive within DeepEP's timeout (about 100 s) leaves the others with DeepEP's failure: the high-throughput CPU side
raises ``DeepEP error: CPU recv timeout``; a device-side wait (low-latency kernels, the destroy barrier) traps and
poisons the buffer.  Both are :class:`DeepEPTimeout`, a liveness failure naming the missing ranks.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from fakes.torch_dist import CollectiveTimeout

TIMEOUT_S = 100.0  # NUM_TIMEOUT_CYCLES at the GPU clock, and the CPU receive timeout: about 100 s
_ids = itertools.count(1)
_TEAMS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # "IPC handle" -> team, while it is used


class DeepEPTimeout(CollectiveTimeout):
    """A DeepEP collective some rank never reached (a liveness failure naming the missing ranks)."""


@dataclass
class _Meeting:
    kind: str
    parity: int | None
    args: dict[int, Any] = field(default_factory=dict)
    done: Any = None
    deadline: Any = None


class Team:
    def __init__(self, kernel, pids: list[int], name: str) -> None:
        self.id = next(_ids)
        self.kernel, self.pids, self.name = kernel, list(pids), name
        self._meetings: dict[int, _Meeting] = {}
        self._seq = [0] * len(pids)
        _TEAMS[self.id] = self

    @staticmethod
    def open(handle: int) -> "Team":
        return _TEAMS[handle]

    def close(self) -> None:
        _TEAMS.pop(self.id, None)

    def meet(
        self,
        rank: int,
        kind: str,
        payload: Any,
        combine: Callable[[list[Any]], list[Any]],
        parity: int | None = None,
        timeout_s: float = TIMEOUT_S,
        device_side: bool = False,
        holds_gil: bool = False,
    ) -> Any:
        """Wait for every rank's call number ``k``; ``combine`` turns the payloads (in rank order) into one result
        per rank.  Raises :class:`DeepEPTimeout` if some rank does not come, or comes with another call.
        ``holds_gil``: the call waits in C++ without releasing the GIL, so the rank's other threads wait with it."""
        seq = self._seq[rank]
        self._seq[rank] += 1
        env = self.kernel.env
        arrived = env.now
        m = self._meetings.get(seq)
        if m is None:
            m = self._meetings[seq] = _Meeting(kind, parity, done=env.event(), deadline=env.timeout(timeout_s))
        if (m.kind, m.parity) != (kind, parity):
            # The other ranks wait for flags this call never writes: both sides time out.
            m.args[rank] = _MISMATCH
        else:
            m.args[rank] = payload
        self.kernel.history.record("deep_ep.arrive", team=self.name, op=kind, seq=seq, pid=self.pids[rank])
        if len(m.args) == len(self.pids) and _MISMATCH not in m.args.values():
            del self._meetings[seq]
            m.done.succeed(combine([m.args[r] for r in range(len(self.pids))]))
        if not m.done.triggered:
            what = f"DeepEP {kind} #{seq} on {self.name}"
            self.kernel.wait(env.any_of([m.done, m.deadline]), what, holds_gil=holds_gil)
            left = arrived + timeout_s - env.now
            if not m.done.triggered and left > 0:
                # The meeting's watchdog runs from its first arrival; a rank that came later waits out its own
                # timeout, as its kernel counts from its own launch.  (Only then: one timer per meeting otherwise.)
                self.kernel.wait(env.any_of([m.done, env.timeout(left)]), what, holds_gil=holds_gil)
        if m.done.triggered and m.args.get(rank) is not _MISMATCH:
            return m.done.value[rank]
        missing = [r for r in range(len(self.pids)) if r not in m.args or m.args[r] is _MISMATCH]
        if m.args.get(rank) is _MISMATCH:
            missing = [r for r in range(len(self.pids)) if r != rank]
        pids = [self.pids[r] for r in missing]
        self.kernel.history.record(
            "deep_ep.timeout", team=self.name, op=kind, seq=seq, pid=self.pids[rank], missing=pids
        )
        what = "device barrier trapped (sticky CUDA error)" if device_side else "DeepEP error: CPU recv timeout"
        raise DeepEPTimeout(
            f"{what}: {kind} #{seq} on {self.name}: ranks {missing} (pids {pids}) did not take part "
            f"within {timeout_s:g} s",
            missing,
        )


class _Mismatch:
    def __repr__(self) -> str:
        return "<another call>"


_MISMATCH = _Mismatch()
