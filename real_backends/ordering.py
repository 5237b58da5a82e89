"""Does a real run's verdict rest on how the torchrun slots' clocks were placed?

A slot on another host puts its events on slot 0's clock with an offset measured at connect, good to within a bound
(:func:`real_backends.launch.measure_clock_offset`).  Two events of different processes closer together than their
bounds may really have happened in the other order, and the judge, which replays the merged history in time order,
could then have given another verdict.  This module judges the run again with each such process's clock at either
end of its bound, alone and against each other such process at the opposite end, and reports every placement that
changes the verdict.  Events of one process keep their order under any shift, so only orderings across processes are
in question.

What it does not try: three or more processes shifted at once in mixed directions, and clock drift during the run
(the bound is measured once, at connect; see docs/real-backend.md).  A run whose processes all share slot 0's clock
has nothing to check and costs nothing here.
"""

from __future__ import annotations

from collections import deque
from itertools import permutations
from typing import Any

from .judge import judge

Event = tuple[float, int, int, str, dict[str, Any]]


def clock_sensitivity(events: list[Event], t0: float, *, completed: bool, stuck: list[str],
                      bounds: dict[int, float]) -> list[str]:
    """One line for each clock placement within ``bounds`` (event source -> seconds) under which the judge's
    (verdict, invariant) differs from the run's as stamped; empty when the verdict holds under every placement
    tried, or when no two processes' events lie close enough for any placement to reorder them."""
    bounds = {src: b for src, b in bounds.items() if b > 0}
    if not bounds or not _reorderable(events, bounds):
        return []

    def outcome(shift: dict[int, float]) -> tuple[str, str | None]:
        moved = [(t + shift.get(src, 0.0), src, seq, kind, fields) for t, src, seq, kind, fields in events]
        return judge(moved, t0, completed=completed, stuck=stuck)[1].verdict()[:2]

    stamped = outcome({})
    placements = [{src: sign * b} for src, b in sorted(bounds.items()) for sign in (1, -1)]
    placements += [{a: bounds[a], b: -bounds[b]} for a, b in permutations(sorted(bounds), 2)]
    found = []
    for shift in placements:
        verdict, invariant = outcome(shift)
        if (verdict, invariant) != stamped:
            where = ", ".join(f"pid {src} {s * 1e3:+.3f} ms" for src, s in sorted(shift.items()))
            found.append(f"{where}: {verdict}" + (f" ({invariant})" if invariant else ""))
    return found


def _reorderable(events: list[Event], bounds: dict[int, float]) -> bool:
    """Whether two events of different processes, one of them placed with a bound, lie within the sum of their
    bounds (only then can a placement within the bounds change their order)."""
    widest = max(bounds.values())
    recent: deque[tuple[float, int]] = deque()  # (t, src) of the events up to 2 * widest before the current one
    for t, src, *_ in sorted(events, key=lambda e: e[0]):
        while recent and t - recent[0][0] > 2 * widest:
            recent.popleft()
        mine = bounds.get(src, 0.0)
        if any(s != src and t - u <= mine + bounds.get(s, 0.0) and mine + bounds.get(s, 0.0) > 0 for u, s in recent):
            return True
        recent.append((t, src))
    return False
