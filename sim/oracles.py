"""Oracles: a run's events judged into a verdict.

Safety: the invariants of :mod:`sim.checkers`, one checker each (``unregistered_access``, ``released_twice``,
``agent_threads``, ``stale_peer``, ``expert_weights``, ``all2all``), fed the events they read as the run goes, so
each violation is tied to the event where it happened; and ``leak``, judged at the end: after shutdown an agent is
still alive, or a registration was never released; or a DeepEP buffer made with ``explicitly_destroy=True`` was
dropped without ``destroy()`` (DeepEP only warns, and its NVLink/RDMA buffers and its hold on NVSHMEM stay for the
life of the process: vLLM's weak buffer cache loses such a buffer when its last strong reference goes before the
cleanup: DeepEP fault 3 of docs/reference/deep-ep.md).

Observations that are not violations under the run's profile (two live agents of one process registering the same
pages on ``dram``) are counted in ``metrics``; under ``rocm-strict`` the fake refuses them and the run crashes.

Liveness: a collective some rank never reached, a worker stuck when the run ended.  Crash: an exception escaped the
code under test.  The verdict is the earliest problem in the history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import crash as crash_mod
from .checkers import CHECKERS, AgentModel, UnregisteredAccess, dispatch
from .trace import History


@dataclass
class Problem:
    verdict: str  # safety, liveness, crash
    invariant: str
    detail: str
    index: int  # position in the history
    t: float = 0.0  # simulated time it was found at
    crash: dict[str, Any] | None = None  # a crash's exception chain and frames (sim.crash.describe)


class Oracles:
    def __init__(self, history: History) -> None:
        """Judges the run whose events go into ``history`` (a simulated cluster's, or a real run's merged ledger);
        it records its findings there too.  The invariants are the checkers of :mod:`sim.checkers`, each fed the
        events it reads."""
        self.history = history
        self.problems: list[Problem] = []
        self.metrics: dict[str, Any] = {
            "registrations": 0,
            "duplicate_registrations": 0,
            "max_live_agents_per_process": 0,
            "agents_created": 0,
            "transfers": 0,
            "bytes_moved": 0,
        }
        self.model = AgentModel(self)
        checkers = [self.model if c is AgentModel else c(self.model, self) for c in CHECKERS]
        self._handlers = dispatch(checkers)
        unregistered = next(c for c in checkers if isinstance(c, UnregisteredAccess))
        self.transfer_moved = unregistered.moved  # the simulated fabric's direct path for a transfer's bytes

    # -- what checkers report ------------------------------------------------------------------------------------
    def problem(self, verdict: str, invariant: str, detail: str) -> None:
        self.problems.append(Problem(verdict, invariant, detail, len(self.history), self.history.now()))
        self.history.record("oracle.violation", verdict=verdict, invariant=invariant, detail=detail)

    def observed(self, kind: str, **fields: Any) -> None:
        self.history.record(kind, **fields)

    # -- events ------------------------------------------------------------------------------------------------
    def on_fabric(self, kind: str, f: dict[str, Any]) -> None:
        """An event of the fake fabric's vocabulary (or the real ledger's, which speaks it)."""
        if kind == "xfer.post":  # half of all events, and nothing reads them
            return
        for handler in self._handlers.get(kind, ()):
            handler(kind, f)

    on_event = on_fabric  # any other event a checker reads (eplb.checked, all2all.checked, engine.reconfigured)

    # -- checks the harness asks for, as the events the real ranks send ------------------------------------------
    def weights_checked(self, pid: int, problems: list[str]) -> None:
        self.on_event("eplb.checked", {"pid": pid, "problems": problems[:1], "count": len(problems)})

    def all2all_checked(self, pid: int, problem: str | None) -> None:
        """A MoE forward through the all2all buffer gave a result other than the single-process reference."""
        self.on_event("all2all.checked", {"pid": pid, "problem": problem})

    def reconfiguration_complete(self, members: list[int]) -> None:
        """No live agent of a member still has an agent of a departed process loaded."""
        self.on_event("engine.reconfigured", {"members": members})

    # -- leaks: judged at the end --------------------------------------------------------------------------------
    def after_shutdown(self) -> None:
        for conn, ranges in sorted(self.model.live.items()):
            self.leaked(conn, len(ranges))
            return

    def leaked(self, conn: str, registrations: int) -> None:
        """Agent ``conn`` outlived the shutdown holding ``registrations`` registrations (the real backend judges it
        at its rank's exit, where the process still holds it)."""
        self.problem(
            "safety",
            "leak",
            f"agent {self.model.name(conn)} of pid {self.model.agent_pid.get(conn)} "
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
