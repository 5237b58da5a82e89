"""The history record of a NIXL event, the same for both worlds: the fake fabric's events (``sim/cluster.py``) and
a real rank's ledger (``real_backends/judge.py``). Kept apart from the cluster so that judging a real run imports
neither torch nor the simulated workers."""

from __future__ import annotations

from typing import Any

HISTORY_FIELDS = ("agent", "pid", "peer", "op", "nbytes", "why", "sections")
XFER_KINDS = {"xfer.post": "nixl.xfer.post", "xfer.done": "nixl.xfer.done"}


def fabric_record(kind: str, fields: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The history record of a NIXL event (the fake's fabric events, or a real rank's ledger): its plain fields,
    a registration's region count instead of its ranges; None for events the history leaves out."""
    if kind == "memory.free":
        return None
    name = XFER_KINDS.get(kind)
    if name is not None:  # half the events of a run: their fields are known
        return name, xfer_record(fields)
    plain = {k: fields[k] for k in HISTORY_FIELDS if k in fields}
    if "ranges" in fields:
        plain["regions"] = len(fields["ranges"])
    return f"nixl.{kind}", plain


def xfer_record(fields: dict[str, Any]) -> dict[str, Any]:
    """The history fields of a transfer's post or completion, from its event's fields."""
    return xfer_fields(fields["agent"], fields["pid"], fields["peer"], fields["op"], fields["nbytes"])


def xfer_fields(agent: str, pid: int, peer: str, op: str, nbytes: int) -> dict[str, Any]:
    """The history fields of a transfer's post or completion (the simulator reads them off the fake's request)."""
    return {"agent": agent, "pid": pid, "peer": peer, "op": op, "nbytes": nbytes}
