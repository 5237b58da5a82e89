"""The ``unregistered_access`` oracle on both sides of a transfer (sim/oracles.py).

A READ lands in its initiator's memory and a WRITE in its target's; either side unregistered at the moment the bytes
move is the finding, named by side.  The local side is reached on NIXL 1.5.1 by a request made before its initiator
deregistered the buffer, which still posts (fact 23 of docs/reference/nixl-1.5.1.md).
"""

from __future__ import annotations

import pytest

from sim.oracles import Oracles
from sim.trace import History


def _pair() -> Oracles:
    """Agents A (pid 0, conn ca) and B (pid 1, conn cb), each with 4 KiB registered at 0x1000 / 0x9000."""
    oracles = Oracles(History(lambda: 0.0))
    for agent, pid, conn, base in (("A", 0, "ca", 0x1000), ("B", 1, "cb", 0x9000)):
        oracles.on_fabric("agent.create", {"agent": agent, "pid": pid, "conn": conn})
        oracles.on_fabric("register", {"agent": agent, "pid": pid, "conn": conn, "ranges": [(base, 4096)]})
    return oracles


def _moved(oracles: Oracles, op: str, local: tuple[int, int], remote: tuple[int, int]) -> None:
    oracles.on_fabric(
        "xfer.done",
        {
            "agent": "A",
            "pid": 0,
            "op": op,
            "nbytes": local[1],
            "conn": "ca",
            "local": [local],
            "target": "cb",
            "remote": [remote],
        },
    )


def test_a_transfer_inside_both_registrations_is_no_finding() -> None:
    oracles = _pair()
    _moved(oracles, "READ", (0x1000, 4096), (0x9000, 4096))
    assert oracles.problems == [] and oracles.metrics["transfers"] == 1 and oracles.metrics["bytes_moved"] == 4096


@pytest.mark.parametrize("op, into", [("READ", "into"), ("WRITE", "from")])
def test_the_initiator_s_own_buffer_released_before_the_bytes_moved_is_named_as_local(op, into) -> None:
    oracles = _pair()
    oracles.on_fabric("deregister", {"agent": "A", "pid": 0, "conn": "ca", "ranges": [(0x1000, 4096)]})
    _moved(oracles, op, (0x1000, 64), (0x9000, 64))
    [p] = oracles.problems
    assert (p.verdict, p.invariant) == ("safety", "unregistered_access")
    assert p.detail == (
        f"{op} by A (pid 0) moved 64 B {into} local memory of A (live) that was not registered at that moment"
    )


def test_a_local_span_past_the_end_of_its_registration_is_a_finding() -> None:
    oracles = _pair()
    _moved(oracles, "READ", (0x1000 + 4000, 200), (0x9000, 200))
    [p] = oracles.problems
    assert p.detail.startswith("READ by A (pid 0) moved ") and "into local memory of A (live)" in p.detail


def test_the_target_destroyed_is_named_as_remote_and_destroyed() -> None:
    oracles = _pair()
    oracles.on_fabric("agent.destroy", {"agent": "B", "pid": 1, "conn": "cb"})
    _moved(oracles, "READ", (0x1000, 64), (0x9000, 64))
    [p] = oracles.problems
    assert p.detail == (
        "READ by A (pid 0) moved 64 B from remote memory of B (destroyed) that was not registered at that moment"
    )
