"""The safety invariants, one checker each, over the events of a run.

Both worlds feed the same events to the same checkers: the simulated cluster as its fake fabric and its workers
make them, the real judge as it replays a real run's merged ledger (:mod:`real_backends.judge`).  An event is a
kind and its fields: the fake fabric's vocabulary for NIXL (``register``, ``xfer.done``, ...; the history records
them under ``nixl.`` names, ``sim/records.py``) and the history's own kinds for the rest (``eplb.checked``,
``all2all.checked``, ``engine.reconfigured``; ``docs/history.md``).  A checker names the kinds it reads; it finds
a violation through :meth:`Verdicts.problem`.

What the NIXL checkers share is :class:`AgentModel`, the registrations and peers of every agent as the events
built them; it takes each event before the checkers after it in :data:`CHECKERS` do.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, ClassVar, Protocol

from fakes.nixl._spans import SpanIndex


class Verdicts(Protocol):
    """Where checkers report (:class:`sim.oracles.Oracles`)."""

    metrics: dict[str, Any]

    def problem(self, verdict: str, invariant: str, detail: str) -> None: ...

    def observed(self, kind: str, **fields: Any) -> None: ...


def spans(pids: list[int]) -> str:
    """[0, 1, 2, 3, 7] -> '0-3, 7': member lists of 64 ranks stay readable in one line."""
    out: list[str] = []
    run: list[int] = []
    for p in sorted(pids):
        if run and p == run[-1] + 1:
            run.append(p)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [p]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


class Checker:
    kinds: ClassVar[tuple[str, ...]] = ()  # the events it reads

    def __init__(self, model: AgentModel, verdicts: Verdicts) -> None:
        self.model, self.verdicts = model, verdicts

    def on(self, kind: str, f: dict[str, Any]) -> None:
        raise NotImplementedError


class AgentModel:
    """Every agent's live registrations (connection -> spans), process and name, the agents destroyed, the peers
    each has loaded, and the ranges each released: the state the NIXL checkers judge against."""

    kinds = ("agent.create", "agent.destroy", "register", "deregister", "peer.load", "peer.remove")

    def __init__(self, verdicts: Verdicts) -> None:
        self.metrics = verdicts.metrics
        self.live: dict[str, SpanIndex] = {}
        self.agent_pid: dict[str, int] = {}
        self.agent_name: dict[str, str] = {}
        self.destroyed: set[str] = set()
        self.peers: dict[str, dict[str, str]] = defaultdict(dict)  # conn -> {peer name: peer conn}
        self.released: dict[str, set[tuple[int, int]]] = defaultdict(set)  # conn -> (addr, len) it deregistered

    def on(self, kind: str, f: dict[str, Any]) -> None:
        conn: Any = f.get("conn")  # (absent from events that are not an agent's)
        if kind == "agent.create":
            self.live[conn] = SpanIndex()
            self.agent_pid[conn], self.agent_name[conn] = f["pid"], f["agent"]
            self.metrics["agents_created"] += 1
            per_pid = sum(1 for c in self.live if self.agent_pid[c] == f["pid"])
            self.metrics["max_live_agents_per_process"] = max(self.metrics["max_live_agents_per_process"], per_pid)
        elif kind == "agent.destroy":
            self.live.pop(conn, None)
            self.peers.pop(conn, None)
            self.destroyed.add(conn)
        elif kind == "register":
            index = self.live.setdefault(conn, SpanIndex())
            for lo, n in f["ranges"]:
                index.add(0, lo, n, (lo, n))
            self.metrics["registrations"] += len(f["ranges"])
        elif kind == "deregister":
            still, released = self.live.get(conn), self.released[conn]
            for r in f["ranges"]:
                if still is not None:
                    still.remove(tuple(r))
                released.add(tuple(r))
        elif kind == "peer.load":
            self.peers[conn][f["peer"]] = f["peer_conn"]
        elif kind == "peer.remove":
            self.peers[conn].pop(f["peer"], None)

    def name(self, conn: Any) -> str:
        return self.agent_name.get(conn, conn)


class DuplicateRegistrations(Checker):
    """An observation, not a violation under the run's profile: two live agents of one process (or one agent twice)
    registering the same pages, counted in ``metrics`` (under ``rocm-strict`` the fake refuses them and the run
    crashes).  It reads a registration before the model adds it."""

    kinds = ("register",)

    def on(self, kind: str, f: dict[str, Any]) -> None:
        conn: Any = f.get("conn")
        pid, model = f["pid"], self.model
        for other, held in model.live.items():
            if model.agent_pid.get(other) != pid:
                continue
            for lo, n in f["ranges"]:
                if any(lo < a + m and a < lo + n for a, m in held.payloads()):
                    self.verdicts.metrics["duplicate_registrations"] += 1
                    self.verdicts.observed(
                        "oracle.duplicate_registration",
                        pid=pid,
                        agent=model.agent_name[conn],
                        other=model.agent_name.get(other, "?"),
                        same_agent=other == conn,
                    )
                    break


class UnregisteredAccess(Checker):
    """``unregistered_access``: bytes moved from or into memory that no live agent had registered at that moment
    (cma/NVLink copy it anyway; an RDMA NIC would fail; either way the strategy relied on a registration it lost)."""

    kinds = ("xfer.done",)

    def on(self, kind: str, f: dict[str, Any]) -> None:
        self.moved(f["agent"], f["pid"], f["op"], f["nbytes"], f["conn"], f["local"], f["target"], f["remote"])

    def moved(self, agent: str, pid: int, op: str, nbytes: int, conn: str, local, target: str | None, remote) -> None:
        """A transfer moved its bytes: both sides must be registered with their agents at this moment.  ``local``
        and ``remote``: its (addr, len) spans in the memory of ``conn`` (the agent that posted it) and ``target``.
        (Half of all events: the simulated cluster calls this directly, with the fake's request read in place.)"""
        metrics = self.verdicts.metrics
        metrics["transfers"] += 1
        metrics["bytes_moved"] += nbytes
        live = self.model.live
        where: Any  # the connection of that side (None: no peer entry for the target)
        for side, where, ranges in (("local", conn, local), ("remote", target, remote)):
            index = live.get(where)
            if index is None:
                missing = ranges[0] if ranges else None
            else:
                missing = index.first_uncovered(0, ranges)
            if missing is not None:
                src = target if op == "READ" else conn
                state = "destroyed" if where in self.model.destroyed else "live"
                self.verdicts.problem(
                    "safety",
                    "unregistered_access",
                    f"{op} by {agent} (pid {pid}) moved {missing[1]} B "
                    f"{'from' if where == src else 'into'} {side} memory of {self.model.name(where)} ({state}) that "
                    "was not registered at that moment",
                )
                return


class ReleasedTwice(Checker):
    """``released_twice``: every registration is released exactly once.  NIXL refuses the second deregistration, so
    no harm came of it here; the owner of the range is confused."""

    kinds = ("deregister.refused",)

    def on(self, kind: str, f: dict[str, Any]) -> None:
        released = self.model.released.get(f["conn"], ())
        again = [tuple(r) for r in f["ranges"] if tuple(r) in released]
        if again:
            self.verdicts.problem(
                "safety",
                "released_twice",  # (no address: details are part of the history)
                f"agent {f['agent']} (pid {f['pid']}) deregistered a range of {again[0][1]} B again "
                "after releasing it: every registration is released exactly once",
            )


class AgentThreads(Checker):
    """``agent_threads``: an agent called by one thread while another thread held open transfer requests on it (NIXL
    1.5.1 agents run in sync mode NONE: two threads using one agent race).  One finding per agent: its first racing
    call."""

    kinds = ("agent.threads",)

    def __init__(self, model: AgentModel, verdicts: Verdicts) -> None:
        super().__init__(model, verdicts)
        self._reported: set[str] = set()

    def on(self, kind: str, f: dict[str, Any]) -> None:
        conn: Any = f.get("conn")  # (absent from events that are not an agent's)
        if conn in self._reported:
            return
        self._reported.add(conn)
        self.verdicts.problem(
            "safety",
            "agent_threads",
            f"agent {f['agent']} (pid {f['pid']}) was called on thread {f['thread']} while "
            f"{', '.join(f['others'])} held {f['open']} open transfer request(s) on it",
        )


class StalePeer(Checker):
    """``stale_peer``: once a reconfiguration completed, no live agent of a member still has an agent of a departed
    process loaded."""

    kinds = ("engine.reconfigured",)

    def on(self, kind: str, f: dict[str, Any]) -> None:
        members, model = f["members"], self.model
        for conn, peers in sorted(model.peers.items()):
            pid = model.agent_pid.get(conn)
            if pid not in members or conn not in model.live:
                continue
            for name, peer_conn in sorted(peers.items()):
                peer_pid = model.agent_pid.get(peer_conn)
                if peer_pid is not None and peer_pid not in members:
                    self.verdicts.problem(
                        "safety",
                        "stale_peer",
                        f"agent {model.agent_name[conn]} (pid {pid}) still has {name} of departed pid "
                        f"{peer_pid} loaded after the reconfiguration to pids {spans(members)}",
                    )
                    return


class ExpertWeights(Checker):
    """``expert_weights``: after a rebalance, a rank's weights differ from the placement (``problems``: the first
    rows that differ, ``count`` of them in all)."""

    kinds = ("eplb.checked",)

    def on(self, kind: str, f: dict[str, Any]) -> None:
        if f["count"]:
            more = f" (and {f['count'] - 1} more rows)" if f["count"] > 1 else ""
            self.verdicts.problem("safety", "expert_weights", f"pid {f['pid']}: {f['problems'][0]}{more}")


class All2all(Checker):
    """``all2all``: a MoE forward through the DeepEP buffer (dispatch, experts, combine) differs from the
    single-process reference."""

    kinds = ("all2all.checked",)

    def on(self, kind: str, f: dict[str, Any]) -> None:
        if f["problem"] is not None:
            self.verdicts.problem("safety", "all2all", f"pid {f['pid']}: {f['problem']}")


# The order in which they see an event: a registration is compared with the live ones before the model adds it.
CHECKERS: tuple[type, ...] = (
    DuplicateRegistrations,
    AgentModel,
    UnregisteredAccess,
    ReleasedTwice,
    AgentThreads,
    StalePeer,
    ExpertWeights,
    All2all,
)


def dispatch(checkers: list[Any]) -> dict[str, list[Callable[[str, dict[str, Any]], None]]]:
    """kind -> the handlers that read it, in the order of ``checkers`` (:data:`CHECKERS`, the model in its place)."""
    table: dict[str, list[Callable[[str, dict[str, Any]], None]]] = defaultdict(list)
    for checker in checkers:
        for kind in checker.kinds:
            table[kind].append(checker.on)
    return dict(table)
