"""Fault hooks of the fake NIXL: armed as data, fired by the fake at its call sites, counted.

A fault is a *site* (where in the fake it acts) with a filter (which agent initiates, in which process, which peer
is targeted) and parameters.  The simulator arms them from a scenario (a fault's ``rank`` becomes ``pid``: only
that process's agents trip it); a unit test arms them directly::

    fabric.faults.arm("xfer.stuck", agent="eplb-1")
    fabric.faults.arm("xfer.late", pid=3, delay=0.5)
    fabric.faults.arm("xfer.fail_after", polls=3, error="REMOTE_DISCONNECT")

Every firing is appended to ``fabric.faults.fired`` as ``(site, agent, peer, now)``, so a run can say which armed
faults fired and which ones it would be implicated in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SITES: dict[str, str] = {
    "register.fail": "register_memory raises (param error: status name, default BACKEND)",
    "xfer.stuck": "a posted transfer never leaves PROC",
    "xfer.fail_after": "the transfer raises at its Nth state check (params: polls, error=REMOTE_DISCONNECT)",
    "xfer.late": "the transfer completes `delay` later than it would (ticks outside the simulator, seconds inside)",
    "notif.drop": "a notification (standalone or carried by a transfer) never arrives",
    "notif.delay": "a notification arrives `delay` later",
    "peer.disconnect": "the first `after_posts` posts (default 0) from an agent to a peer succeed; the next one fails "
    "that endpoint",
}

# The parameters each site reads; anything else is a typo and refused.
PARAMS: dict[str, frozenset[str]] = {
    "register.fail": frozenset({"error"}),
    "xfer.stuck": frozenset(),
    "xfer.fail_after": frozenset({"polls", "error"}),
    "xfer.late": frozenset({"delay"}),
    "notif.drop": frozenset(),
    "notif.delay": frozenset({"delay"}),
    "peer.disconnect": frozenset({"after_posts"}),
}

STATUS_BY_NAME = {
    "NOT_POSTED": -1,
    "INVALID_PARAM": -2,
    "BACKEND": -3,
    "NOT_FOUND": -4,
    "MISMATCH": -5,
    "NOT_ALLOWED": -6,
    "REPOST_ACTIVE": -7,
    "UNKNOWN": -8,
    "NOT_SUPPORTED": -9,
    "REMOTE_DISCONNECT": -10,
    "CANCELED": -11,
}


@dataclass
class ArmedFault:
    site: str
    agent: str | None = None  # only calls by the agent of this name
    peer: str | None = None  # only transfers and notifications towards this peer
    times: int | None = None  # how often it may fire; None: every time it matches
    params: dict[str, Any] = field(default_factory=dict)
    fired: int = 0
    first_fired_at: float | None = None  # fabric time of its first firing
    seen: dict = field(default_factory=dict)  # (agent, peer) -> matches so far, for "at the Nth" parameters
    pid: int | None = None  # only calls by agents of this process (the simulator's ``rank=``)

    def matches(self, site: str, agent: str | None, peer: str | None, pid: int | None = None) -> bool:
        if site != self.site or (self.times is not None and self.fired >= self.times):
            return False
        return (
            (self.agent is None or self.agent == agent)
            and (self.peer is None or self.peer == peer)
            and (self.pid is None or self.pid == pid)
        )

    def __repr__(self) -> str:
        who = ", ".join(
            f"{k}={v!r}" for k, v in (("agent", self.agent), ("pid", self.pid), ("peer", self.peer)) if v is not None
        )
        extra = ", ".join(f"{k}={v!r}" for k, v in sorted(self.params.items()))
        return f"<ArmedFault {self.site}({', '.join(x for x in (who, extra) if x)}) fired={self.fired}>"


class FaultBoard:
    def __init__(self, now) -> None:
        self._now = now
        self.armed: list[ArmedFault] = []
        self.fired: list[tuple[str, str | None, str | None, float]] = []

    def arm(
        self,
        site: str,
        *,
        agent: str | None = None,
        peer: str | None = None,
        times: int | None = None,
        pid: int | None = None,
        **params: Any,
    ) -> ArmedFault:
        if site not in SITES:
            raise LookupError(f"fault site {site!r} not found; known: {', '.join(SITES)}")
        unknown = sorted(set(params) - PARAMS[site])
        if unknown:
            allowed = ", ".join(sorted(PARAMS[site])) or "none"
            raise ValueError(f"fault site {site!r} takes no parameter {unknown[0]!r}; it takes: {allowed}")
        error = params.get("error")
        if error is not None and error not in STATUS_BY_NAME:
            raise ValueError(f"fault error {error!r} is not a NIXL status; use one of {', '.join(STATUS_BY_NAME)}")
        fault = ArmedFault(site, agent, peer, times, dict(params), pid=pid)
        self.armed.append(fault)
        return fault

    def disarm_all(self) -> None:
        """The healing phase of a run: nothing fires any more, what already fired stays recorded."""
        self.armed.clear()

    def take(
        self, site: str, agent: str | None, peer: str | None = None, *, pid: int | None = None, nth: str | None = None
    ) -> ArmedFault | None:
        """The first armed fault matching this call site (``agent``, of process ``pid``, towards ``peer``), marked
        as fired; None if none applies.

        With ``nth="after_posts"`` the fault fires only once it has matched ``params[nth]`` times before for this
        (agent, peer) pair: an endpoint is one pair's, so each pair counts its own posts.
        """
        if not self.armed:  # the common case: every transfer asks three or four times
            return None
        for fault in self.armed:
            if not fault.matches(site, agent, peer, pid):
                continue
            if nth is not None:
                seen = fault.seen[agent, peer] = fault.seen.get((agent, peer), 0) + 1
                if seen <= int(fault.params.get(nth, 0)):
                    continue
            fault.fired += 1
            now = self._now()
            if fault.first_fired_at is None:
                fault.first_fired_at = now
            self.fired.append((site, agent, peer, now))
            return fault
        return None
