"""A run's outcome, the same for both worlds: the :class:`Result` that ``epsim run`` prints, sweeps store and bundles
keep, and the failure signature that groups failures.  Kept apart from the simulation so that a real run's parent
process (which judges, and moves no tensor) does not import torch with it."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from . import crash as crash_mod


@dataclass
class Result:
    verdict: str
    invariant: str | None
    detail: str | None
    seed: int
    scenario: str
    strategy: str
    profile: str
    trace_hash: str
    events: int
    sim_time_s: float
    wall_s: float
    faults_armed: list[str] = field(default_factory=list)
    faults_fired: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    implicated: list[str] = field(default_factory=list)  # armed faults that fired before the failure, first first
    signature: str | None = None  # how failures are grouped: invariant, strategy, first implicated fault site
    # [what, start s, end s] of every rebalance and reconfiguration (scale_up, scale_down, abort), in run time
    spans: list[list[Any]] = field(default_factory=list)
    # A crash's exception chain and the frames of the code under test (sim.crash.describe); None for other verdicts
    crash: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_CRASH_TYPE = re.compile(r"\(pid -?\d+\): ([A-Za-z_][\w.]*):")


def signature(
    verdict: str,
    invariant: str | None,
    detail: str | None,
    strategy: str,
    implicated: list[str],
    crash: dict[str, Any] | None = None,
) -> str | None:
    """``invariant|strategy|first implicated fault site`` (None for a pass).  A crash's first part names its
    exceptions and where they came from, ``exception:OUTER[<-ROOT][@FUNCTION]``: the type of the exception that
    escaped, the type of its root cause when it was raised from or while handling another, and the innermost
    function of the code under test it was raised through (``crash``'s ``origin``, see :mod:`sim.crash`), e.g.
    ``exception:RuntimeError<-nixlBackendError@NixlEplbCommunicator.__init__``: two different root causes, or one
    raised in two different places, are two different bugs.  Without ``crash`` (its data did not come), the type
    named in ``detail``."""
    if verdict == "pass":
        return None
    what = invariant or verdict
    if verdict == "crash":
        if crash and crash.get("chain"):
            what = f"{what}:{crash_mod.signature_part(crash)}"
        else:
            found = _CRASH_TYPE.search(detail or "")
            if found:
                what = f"{what}:{found.group(1)}"
    site = implicated[0].partition(":")[0] if implicated else "-"
    return f"{what}|{strategy}|{site}"


_LEGACY_CRASH = re.compile(r"^(exception:[^|<@]+)[^|]*")


def same_signature(expected: str | None, got: str | None) -> bool:
    """Whether a run's signature ``got`` is the ``expected`` one a bundle or a database stored.  A crash signature
    stored before signatures named the root cause and the function (``exception:RuntimeError|...``) matches a run
    whose exception that escaped is of that type, whatever its root cause and function."""
    if expected == got:
        return True
    if not expected or not got or not expected.startswith("exception:"):
        return False
    head = expected.partition("|")[0]
    return "<-" not in head and "@" not in head and _LEGACY_CRASH.sub(r"\1", got) == expected
