"""Does a real run's verdict rest on how the torchrun slots' clocks were placed?

A slot on another host puts its events on slot 0's clock with an offset measured at connect, good to within a bound
(:func:`real_backends.launch.measure_clock_offset`); the slots of one host share one offset (they read one clock).
Two events of different hosts closer together than their bounds may really have happened in the other order, and
the judge, which replays the merged history in time order, could then have given another verdict.  This module
judges the run again under other placements within the bounds and reports each one that changes the verdict:

- every pair of such events that the judge's checks can tell apart, put the other way round: the two hosts'
  clocks shifted just past the point where the pair swaps, everything else as stamped;
- each host's clock at either end of its bound, alone and against each other host at the opposite end, and all
  of them at once at either end (many pairs swapped together).

Events of one host keep their order under any shift.  Pairs the checks cannot tell apart are not tried: two
completed transfers (each checks the registrations of its moment; neither changes them), and anything against an
event the judge only records (``xfer.post``, a rebalance's timing, serving).  What is not tried: swaps that need
three or more hosts shifted at once in mixed directions, or several pairs swapped at once at shifts inside the
bounds, and clock drift during the run (the bound is measured once, at connect; see docs/real-backend.md).  A run
whose processes all read slot 0's clock has nothing to check and costs nothing here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import permutations
from typing import Any

from .judge import LEDGER, judge

Event = tuple[float, int, int, str, dict[str, Any]]

# What the judge's checks see, and so what a swap can matter to (everything else only goes into the history).
CHECKED = (LEDGER - {"xfer.post"}) | {
    "thread.crash",
    "process.exit",
    "process.kill",
    "engine.stuck",
    "worker.exit",
    "engine.reconfigured",
    "eplb.checked",
}
MAX_JUDGINGS = 400  # placements judged at most per run (each replays the whole history); the rest are counted
PAST_S = 1e-9  # how far past a swap point a placement goes (event times are seconds of a monotonic clock)


@dataclass
class Sensitivity:
    """``changed``: one line per placement that changes the (verdict, invariant); ``tried`` of ``placements``."""

    changed: list[str] = field(default_factory=list)
    tried: int = 0
    placements: int = 0


def clock_sensitivity(
    events: list[Event], t0: float, *, completed: bool, stuck: list[str], clocks: dict[int, tuple[str, float]]
) -> Sensitivity:
    """Judge ``events`` again under placements within ``clocks`` (event source -> (clock, bound in s): sources
    of one clock shift together; a source not in it reads slot 0's clock)."""
    bounds: dict[str, float] = {}
    members: dict[str, list[int]] = {}
    for src, (clock, bound) in sorted(clocks.items()):
        bounds[clock] = max(bounds.get(clock, 0.0), bound)
        members.setdefault(clock, []).append(src)
    bounds = {clock: b for clock, b in bounds.items() if b > 0}
    if not bounds:
        return Sensitivity()
    clock_of = {src: clock for clock in bounds for src in members[clock]}
    swaps = _swaps(events, clock_of, bounds)
    if not swaps:
        return Sensitivity()
    ends = [{c: sign * b} for c, b in sorted(bounds.items()) for sign in (1, -1)]
    ends += [{a: bounds[a], b: -bounds[b]} for a, b in permutations(sorted(bounds), 2)]
    ends += [{c: sign * b for c, b in bounds.items()} for sign in (1, -1)] if len(bounds) > 1 else []
    placements = _unique(ends + swaps)

    def outcome(shift: dict[str, float]) -> tuple[str, str | None]:
        by_src = {src: shift[clock] for src, clock in clock_of.items() if clock in shift}
        moved = [(t + by_src.get(src, 0.0), src, seq, kind, fields) for t, src, seq, kind, fields in events]
        return judge(moved, t0, completed=completed, stuck=stuck)[1].verdict()[:2]

    stamped = outcome({})
    found = Sensitivity(placements=len(placements))
    for shift in placements[:MAX_JUDGINGS]:
        found.tried += 1
        verdict, invariant = outcome(shift)
        if (verdict, invariant) != stamped:
            where = ", ".join(
                f"pid{'s' if len(members[c]) > 1 else ''} {','.join(map(str, members[c]))} {s * 1e3:+.3f} ms"
                for c, s in sorted(shift.items())
            )
            found.changed.append(f"{where}: {verdict}" + (f" ({invariant})" if invariant else ""))
    return found


def _swaps(events: list[Event], clock_of: dict[int, str], bounds: dict[str, float]) -> list[dict[str, float]]:
    """For each pair of checked events of two clocks that lie within the sum of the clocks' bounds, the
    placement (clock -> shift) that puts the later one just before the earlier one, the later one's clock as little
    shifted as it can be."""
    widest = max(bounds.values())
    found = []
    recent: deque[tuple[float, str, str]] = deque()  # (t, clock, kind) of checked events up to 2 * widest back
    for t, src, _, kind, _ in sorted((e for e in events if e[3] in CHECKED), key=lambda e: (e[0], e[1], e[2])):
        while recent and t - recent[0][0] > 2 * widest:
            recent.popleft()
        clock = clock_of.get(src, "")  # "": slot 0's, not shifted
        mine = bounds.get(clock, 0.0)
        for u, other, other_kind in recent:
            if other == clock or kind == other_kind == "xfer.done":
                continue
            past = t - u + PAST_S  # the earlier one's clock must gain this much on the later one's
            if past > mine + bounds.get(other, 0.0):
                continue
            gain = min(bounds.get(other, 0.0), past)  # the earlier one's clock forward as far as it may go, ...
            shift = {other: gain, clock: gain - past}  # ... the later one's back by the rest
            found.append({c: s for c, s in shift.items() if c and s})
        recent.append((t, clock, kind))
    return found


def _unique(placements: list[dict[str, float]]) -> list[dict[str, float]]:
    seen, out = set(), []
    for shift in placements:
        key = tuple(sorted((c, round(s, 12)) for c, s in shift.items()))
        if key not in seen:
            seen.add(key)
            out.append(shift)
    return out
