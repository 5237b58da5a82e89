"""Oracles: invariants over live state and the event history, judged into a verdict.

Safety invariants (checked as the run goes, each violation tied to the event where it happened):

- ``unregistered_access``: bytes moved from or into memory that no live agent had registered at that moment
  (cma/NVLink copy it anyway; an RDMA NIC would fail; either way the strategy relied on a registration it lost);
- ``expert_weights``: after a rebalance, a rank's weights differ from the placement;
- ``all2all``: a MoE forward through the DeepEP buffer (dispatch, experts, combine) differs from the reference;
- ``stale_peer``: after a reconfiguration completed, a live agent still has a departed agent loaded;
- ``agent_threads``: an agent was called by one thread while another thread held open transfer requests on it
  (NIXL 1.5.1 agents run in sync mode NONE: two threads using one agent race);
- ``leak``: after shutdown an agent is still alive, or a registration was never released; or a DeepEP buffer made
  with ``explicitly_destroy=True`` was dropped without ``destroy()`` (DeepEP only warns, and its NVLink/RDMA buffers
  and its hold on NVSHMEM stay for the life of the process: vLLM's weak buffer cache loses such a buffer when its
  last strong reference goes before the cleanup: DeepEP fault 3 of docs/reference/deep-ep.md).

Observations that are not violations under the run's profile (two live agents of one process registering the same
pages on ``dram``) are counted in ``metrics``; under ``rocm-strict`` the fake refuses them and the run crashes.

Liveness: a collective some rank never reached, a worker stuck when the run ended.  Crash: an exception escaped the
code under test.  The verdict is the earliest problem in the history.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from fakes.nixl._spans import SpanIndex

from . import crash as crash_mod
from .trace import History


@dataclass
class Problem:
    verdict: str  # safety, liveness, crash
    invariant: str
    detail: str
    index: int  # position in the history
    t: float = 0.0  # simulated time it was found at
    crash: dict[str, Any] | None = None  # a crash's exception chain and frames (sim.crash.describe)


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


class Oracles:
    def __init__(self, history: History) -> None:
        """Judges the run whose events go into ``history`` (a simulated cluster's, or a real run's merged ledger);
        it records its findings there too."""
        self.history = history
        self.live: dict[str, SpanIndex] = {}  # agent conn -> live registered ranges
        self.agent_pid: dict[str, int] = {}
        self.agent_name: dict[str, str] = {}
        self.destroyed: set[str] = set()
        self.peers: dict[str, dict[str, str]] = defaultdict(dict)  # conn -> {peer name: peer conn}
        self._shared_use: set[str] = set()  # agents already reported as used by two threads at once
        self.released: dict[str, set[tuple[int, int]]] = defaultdict(set)  # conn -> (addr, len) it deregistered
        self.problems: list[Problem] = []
        self.metrics: dict[str, Any] = {
            "registrations": 0,
            "duplicate_registrations": 0,
            "max_live_agents_per_process": 0,
            "agents_created": 0,
            "transfers": 0,
            "bytes_moved": 0,
        }

    def _problem(self, verdict: str, invariant: str, detail: str) -> None:
        self.problems.append(Problem(verdict, invariant, detail, len(self.history), self.history.now()))
        self.history.record("oracle.violation", verdict=verdict, invariant=invariant, detail=detail)

    # -- the fabric's events ----------------------------------------------------------------------------------
    def on_fabric(self, kind: str, f: dict[str, Any]) -> None:
        if kind == "xfer.done":  # half of all events, and the other half (xfer.post) needs nothing here
            self.transfer_done(f)
            return
        if kind == "xfer.post":
            return
        conn: Any = f.get("conn")  # the agent's connection (absent from events that are not an agent's)
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
            self._note_duplicates(conn, f["pid"], f["ranges"])
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
        elif kind == "deregister.refused":
            again = [tuple(r) for r in f["ranges"] if tuple(r) in self.released.get(conn, ())]
            if again:  # NIXL refused it, so no harm came of it here; the owner of the range is confused
                self._problem(
                    "safety",
                    "released_twice",  # (no address: details are part of the history)
                    f"agent {f['agent']} (pid {f['pid']}) deregistered a range of {again[0][1]} B again "
                    "after releasing it: every registration is released exactly once",
                )
        elif kind == "peer.load":
            self.peers[conn][f["peer"]] = f["peer_conn"]
        elif kind == "peer.remove":
            self.peers[conn].pop(f["peer"], None)
        elif kind == "agent.threads" and conn not in self._shared_use:
            self._shared_use.add(conn)  # one violation per agent: its first racing call is the finding
            self._problem(
                "safety",
                "agent_threads",
                f"agent {f['agent']} (pid {f['pid']}) was called on thread {f['thread']} while "
                f"{', '.join(f['others'])} held {f['open']} open transfer request(s) on it",
            )

    def _note_duplicates(self, conn: str, pid: int, ranges: list[tuple[int, int]]) -> None:
        for other, held in self.live.items():
            if self.agent_pid.get(other) != pid:
                continue
            for lo, n in ranges:
                if any(lo < a + m and a < lo + n for a, m in held.payloads()):
                    self.metrics["duplicate_registrations"] += 1
                    self.history.record(
                        "oracle.duplicate_registration",
                        pid=pid,
                        agent=self.agent_name[conn],
                        other=self.agent_name.get(other, "?"),
                        same_agent=other == conn,
                    )
                    break

    def transfer_done(self, f: dict[str, Any]) -> None:
        """A transfer moved its bytes (an ``xfer.done`` event's fields)."""
        self.transfer_moved(f["agent"], f["pid"], f["op"], f["nbytes"], f["conn"], f["local"], f["target"], f["remote"])

    def transfer_moved(
        self, agent: str, pid: int, op: str, nbytes: int, conn: str, local, target: str | None, remote
    ) -> None:
        """A transfer moved its bytes: both sides must be registered with their agents at this moment.  ``local``
        and ``remote``: its (addr, len) spans in the memory of ``conn`` (the agent that posted it) and ``target``."""
        metrics = self.metrics
        metrics["transfers"] += 1
        metrics["bytes_moved"] += nbytes
        live = self.live
        where: Any  # the connection of that side (None: no peer entry for the target)
        for side, where, spans in (("local", conn, local), ("remote", target, remote)):
            index = live.get(where)
            if index is None:
                missing = spans[0] if spans else None
            else:
                missing = index.first_uncovered(0, spans)
            if missing is not None:
                src = target if op == "READ" else conn
                who = self.agent_name.get(where, where)
                state = "destroyed" if where in self.destroyed else "live"
                self._problem(
                    "safety",
                    "unregistered_access",
                    f"{op} by {agent} (pid {pid}) moved {missing[1]} B "
                    f"{'from' if where == src else 'into'} {side} memory of {who} ({state}) that was "
                    "not registered at that moment",
                )
                return

    # -- checks the harness asks for ----------------------------------------------------------------------------
    def weights_checked(self, pid: int, problems: list[str]) -> None:
        if problems:
            more = f" (and {len(problems) - 1} more rows)" if len(problems) > 1 else ""
            self._problem("safety", "expert_weights", f"pid {pid}: {problems[0]}{more}")

    def all2all_checked(self, pid: int, problem: str | None) -> None:
        """A MoE forward through the all2all buffer gave a result other than the single-process reference."""
        if problem is not None:
            self._problem("safety", "all2all", f"pid {pid}: {problem}")

    def reconfiguration_complete(self, members: list[int]) -> None:
        """No live agent of a member still has an agent of a departed process loaded."""
        for conn, peers in sorted(self.peers.items()):
            pid = self.agent_pid.get(conn)
            if pid not in members or conn not in self.live:
                continue
            for name, peer_conn in sorted(peers.items()):
                peer_pid = self.agent_pid.get(peer_conn)
                if peer_pid is not None and peer_pid not in members:
                    self._problem(
                        "safety",
                        "stale_peer",
                        f"agent {self.agent_name[conn]} (pid {pid}) still has {name} of departed pid "
                        f"{peer_pid} loaded after the reconfiguration to pids {spans(members)}",
                    )
                    return

    def after_shutdown(self) -> None:
        for conn, ranges in sorted(self.live.items()):
            self.leaked(conn, len(ranges))
            return

    def leaked(self, conn: str, registrations: int) -> None:
        """Agent ``conn`` outlived the shutdown holding ``registrations`` registrations (the real backend judges it
        at its rank's exit, where the process still holds it)."""
        self._problem(
            "safety",
            "leak",
            f"agent {self.agent_name.get(conn, conn)} of pid {self.agent_pid.get(conn)} "
            f"is still alive after shutdown holding {registrations} registrations",
        )

    def buffer_leaked(self, pid: int, team: str, index: int, t: float) -> None:
        self.problems.append(
            Problem(
                "safety",
                "leak",
                f"pid {pid}: DeepEP buffer {team} was dropped without "
                "destroy() (explicitly_destroy=True): DeepEP only warns, and "
                "its buffers stay allocated",
                index,
                t,
            )
        )

    def crashed(self, thread: str, pid: int, exc: BaseException, index: int) -> None:
        from fakes.torch_dist import CollectiveTimeout

        now = self.history.now()
        if isinstance(exc, CollectiveTimeout):
            self.problems.append(Problem("liveness", "collective_timeout", f"{thread}: {exc}", index, now))
            return
        # The exception still has its traceback: the kernel keeps what escaped each thread as it escaped.
        info = crash_mod.describe(exc, thread, pid)
        if _caused_by(exc, CollectiveTimeout):
            # A peer that never reached a collective, reported by the code under test in an exception of its own
            # (vLLM: "NIXL EPLB init failed: agents"): what did not converge is the group, whatever wraps it.
            self.problems.append(
                Problem("liveness", "collective_timeout", f"{thread}: {crash_mod.line(info)}", index, now, info)
            )
        else:
            self.problems.append(
                Problem("crash", "exception", f"{thread} (pid {pid}): {crash_mod.line(info)}", index, now, info)
            )

    def stuck(self, detail: str) -> None:
        self.problems.append(Problem("liveness", "stuck", detail, len(self.history), self.history.now()))

    def first_problem(self) -> Problem | None:
        return min(self.problems, key=lambda p: p.index) if self.problems else None

    def verdict(self) -> tuple[str, str | None, str | None]:
        first = self.first_problem()
        if first is None:
            return "pass", None, None
        return first.verdict, first.invariant, first.detail


def _caused_by(exc: BaseException | None, kind: type) -> bool:
    """Whether ``exc`` or an exception it was raised from (``__cause__``, else ``__context__``) is a ``kind``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
