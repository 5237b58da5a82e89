"""Cases the fake process groups (fakes/torch_dist.py) and gloo must agree on: what a rank's collectives give, and
when, when a member is late, when ``Work.wait`` has a bound, and when a member's process is killed.

A case body is ordinary code against ``torch.distributed`` with an explicit ``group=`` and the ``time`` module, run
once per rank: in the simulation on fake groups in simulated time, on the real side in one process per rank on a
stateless gloo group (as vLLM's elastic EP makes them, ``real_backends.groups``) in wall-clock time.  Each body
returns what it saw as ``(label, outcome, seconds)`` rows: when the call returned on the case's clock, which every
rank (and on the real side the parent that kills a rank) starts at the same instant.  The cases space their events
a second or more apart, and :func:`agree` accepts a real row up to ``SLACK_S`` late."""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Callable

WORLD = 3


def outcome(exc: BaseException) -> str:
    """What a failed call means, in words both implementations' messages map to."""
    text = str(exc).lower()
    if "operation timed out" in text:
        return "error: operation timed out"
    # gloo says either, by which side of the pair noticed first (seen both on one machine, run to run)
    if "connection closed by peer" in text or "connection reset by peer" in text:
        return "error: connection closed by peer"
    return f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


SLACK_S = 0.4  # how late a real row may be (scheduling on a loaded machine); the fake's rows are exact


class Clock:
    """The case's clock: seconds since ``t0`` (``time.monotonic()``, one clock for every process of the machine)."""

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = time.monotonic() if t0 is None else t0

    def seconds(self) -> float:
        return round(time.monotonic() - self.t0, 3)


def agree(seen: dict[int, list], expected: dict[int, list]) -> bool:
    """Same ranks, same rows, each at its expected second or up to SLACK_S later."""
    return seen.keys() == expected.keys() and all(
        len(seen[r]) == len(expected[r])
        and all(
            (label, what) == (want_label, want_what) and want_t <= t < want_t + SLACK_S
            for (label, what, t), (want_label, want_what, want_t) in zip(seen[r], expected[r])
        )
        for r in expected
    )


def _call(rows: list, clock: Clock, label: str, fn: Callable[[], object]) -> None:
    try:
        value = fn()
        rows.append((label, "ok" if value is None else f"ok: {value}", clock.seconds()))
    except Exception as exc:  # noqa: BLE001 - the outcome is the row
        rows.append((label, outcome(exc), clock.seconds()))


def wait_with_a_bound(group, rank: int, clock: Clock) -> list:
    """Rank 2 arrives at 2 s; the others wait on their all_reduce with a 1 s bound, then without one."""
    import torch
    import torch.distributed as dist

    rows: list = []
    t = torch.full((1,), float(rank + 1))
    if rank == 2:
        time.sleep(2.0)
        _call(rows, clock, "all_reduce", lambda: dist.all_reduce(t, group=group))
    else:
        work = dist.all_reduce(t, group=group, async_op=True)
        _call(rows, clock, "wait 1 s", lambda: work.wait(timeout=datetime.timedelta(seconds=1)) and None)
        rows.append(("completed after the bound", str(work.is_completed()), clock.seconds()))
        _call(rows, clock, "wait", lambda: work.wait() and None)
    rows.append(("sum", str(t.item()), clock.seconds()))
    after = torch.ones(1)
    _call(rows, clock, "next all_reduce", lambda: dist.all_reduce(after, group=group))
    rows.append(("next sum", str(after.item()), clock.seconds()))
    return rows


def wait_with_a_zero_bound(group, rank: int, clock: Clock) -> list:
    """A zero timeout is no bound: the others wait for rank 2, which arrives at 2 s."""
    import torch.distributed as dist

    rows: list = []
    if rank == 2:
        time.sleep(2.0)
    work = dist.barrier(group=group, async_op=True)
    _call(rows, clock, "wait 0 s", lambda: work.wait(timeout=datetime.timedelta(0)) and None)
    return rows


def killed_while_the_others_wait(group, rank: int, clock: Clock) -> list:
    """Rank 2 is killed at 1 s, while the others wait in an all_reduce; then they try a barrier."""
    import torch
    import torch.distributed as dist

    rows: list = []
    if rank == 2:
        time.sleep(30.0)  # killed before it wakes
    _call(rows, clock, "all_reduce", lambda: dist.all_reduce(torch.ones(1), group=group))
    _call(rows, clock, "barrier", lambda: dist.barrier(group=group))
    return rows


def killed_before_the_others_arrive(group, rank: int, clock: Clock) -> list:
    """Rank 2 is killed at 1 s; the others reach their all_reduce at 2 s."""
    import torch
    import torch.distributed as dist

    rows: list = []
    time.sleep(30.0 if rank == 2 else 2.0)
    _call(rows, clock, "all_reduce", lambda: dist.all_reduce(torch.ones(1), group=group))
    _call(rows, clock, "barrier", lambda: dist.barrier(group=group))
    return rows


@dataclass(frozen=True)
class Case:
    body: Callable
    kill: tuple[int, float] | None = None  # (rank, second): that rank's process is killed then
    expected: dict | None = None  # rank -> rows; the killed rank has none


_LATE = [
    ("wait 1 s", "error: operation timed out", 1),
    ("completed after the bound", "False", 1),
    ("wait", "ok", 2),
    ("sum", "6.0", 2),
    ("next all_reduce", "ok", 2),
    ("next sum", "3.0", 2),
]
_CLOSED_AT_1 = [
    ("all_reduce", "error: connection closed by peer", 1),
    ("barrier", "error: connection closed by peer", 1),
]
_CLOSED_AT_2 = [
    ("all_reduce", "error: connection closed by peer", 2),
    ("barrier", "error: connection closed by peer", 2),
]

CASES = {
    "wait_with_a_bound": Case(
        wait_with_a_bound,
        expected={
            0: _LATE,
            1: _LATE,
            2: [("all_reduce", "ok", 2), ("sum", "6.0", 2), ("next all_reduce", "ok", 2), ("next sum", "3.0", 2)],
        },
    ),
    "wait_with_a_zero_bound": Case(wait_with_a_zero_bound, expected={r: [("wait 0 s", "ok", 2)] for r in range(3)}),
    "killed_while_the_others_wait": Case(
        killed_while_the_others_wait, kill=(2, 1.0), expected={0: _CLOSED_AT_1, 1: _CLOSED_AT_1}
    ),
    "killed_before_the_others_arrive": Case(
        killed_before_the_others_arrive, kill=(2, 1.0), expected={0: _CLOSED_AT_2, 1: _CLOSED_AT_2}
    ),
}
