"""Judging a real run: the ranks' merged event history replayed through the simulation's oracles.

Every rank streamed its events stamped with the host's monotonic clock; merged in time order they are one history,
and :class:`sim.oracles.Oracles` sees the ledger events exactly as it sees the fake fabric's: agent names become the
connection of the agent that carried the name at that moment, so a peer loaded by name is tied to the process that
owned it.  The engine's markers (a reconfiguration completed, a rank's weights checked, a crash) call the same
checks the simulation calls at the same points.

Across processes "at that moment" is only as good as the clock: a READ is judged at the moment it completed,
which the reading process observed after the source's memory was read.
"""

from __future__ import annotations

from typing import Any

from sim.records import fabric_record
from sim.oracles import Oracles, Problem
from sim.trace import History

LEDGER = frozenset(
    {
        "agent.create",
        "agent.destroy",
        "register",
        "deregister",
        "deregister.refused",
        "peer.load",
        "peer.remove",
        "xfer.post",
        "xfer.done",
        "agent.threads",
    }
)
# A collective that fails because a member died is what the simulation calls a collective timeout: gloo notices
# the closed connection at once instead of waiting out the timeout.  So is a Work.wait(timeout) that ran out
# ("Operation timed out!", a RuntimeError, as the fake raises a CollectiveTimeout).
COLLECTIVE_ERROR_TYPES = frozenset(
    {"RuntimeError", "DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "TimeoutError"}
)
COLLECTIVE_FAILURE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out waiting",
    "Gloo",
    "gloo",
    "Socket Timeout",
    "Operation timed out!",
)


def judge(
    events: list[tuple[float, int, int, str, dict[str, Any]]], t0: float, *, completed: bool, stuck: list[str]
) -> tuple[History, Oracles]:
    clock = [0.0]
    history = History(lambda: clock[0])
    oracles = Oracles(history)
    by_name: dict[str, str] = {}  # agent name -> the connection that carries it now
    leaked: dict[str, int] = {}  # agent alive at its rank's exit, held by nothing on purpose -> its registrations
    waits = iter(stuck)  # the parent's stuck details, in the order of its engine.stuck records
    for t, _, _, kind, fields in sorted(events, key=lambda e: (e[0], e[1], e[2])):
        clock[0] = t - t0
        if kind in LEDGER:
            _ledger(oracles, history, by_name, kind, dict(fields))
        elif kind == "eplb.move_loop":  # which code moved the experts: a metric, as in the simulation, not an event
            if fields["loop"] == "vllm":
                oracles.metrics["move_loop"] = "vllm"
        elif kind == "thread.crash":
            # The traceback and the crash's frames stay out of the history: line numbers are not events.
            history.record(kind, **{k: v for k, v in fields.items() if k not in ("traceback", "crash")})
            _crash(oracles, history, fields)
        else:
            history.record(kind, **fields)
            if kind in ("process.exit", "process.kill"):
                _process_gone(oracles, history, fields["pid"])
            elif kind == "engine.stuck":  # judged where it happened, before whatever the teardown broke after it
                detail = next(waits, None)
                if detail is not None:
                    oracles.stuck(detail)
            elif kind == "worker.exit":
                live = oracles.model.live
                leaked.update((c, len(live[c])) for c in fields.get("leaked", ()) if c in live)
            elif kind == "deep_ep.leak":  # DeepEP's warning, seen on the rank's stdout (real_backends/rank.py)
                oracles.buffer_leaked(fields["pid"], fields["team"], len(history) - 1, clock[0])
            else:  # to the checkers that read it (engine.reconfigured, eplb.checked, all2all.checked)
                oracles.on_event(kind, fields)
    for detail in waits:  # none left unless a record was lost
        oracles.stuck(detail)
    if completed and not oracles.problems:
        for conn, registrations in sorted(leaked.items())[:1]:  # the simulation's check, at each rank's exit
            oracles.leaked(conn, registrations)
        oracles.after_shutdown()
    return history, oracles


def _ledger(oracles: Oracles, history: History, by_name: dict[str, str], kind: str, f: dict[str, Any]) -> None:
    if kind == "agent.create":
        by_name[f["agent"]] = f["conn"]
    elif kind == "peer.load":
        f["peer_conn"] = by_name.get(f["peer"], f"?{f['peer']}")
    elif kind in ("xfer.done", "xfer.post"):
        f["target"] = by_name.get(f["peer"], f"?{f['peer']}")
    entry = fabric_record(kind, f)
    if entry is not None:
        history.record(entry[0], **entry[1])
    oracles.on_fabric(kind, f)


def _process_gone(oracles: Oracles, history: History, pid: int) -> None:
    """A process that ended took its agents with it, also those a late finalizer or interpreter exit never
    destroyed (as the fake's ``kill_process`` does)."""
    model = oracles.model
    for conn in sorted(c for c in model.live if model.agent_pid.get(c) == pid):
        f = {"conn": conn, "agent": model.name(conn), "pid": pid}
        history.record("nixl.agent.destroy", agent=f["agent"], pid=pid, why="process ended")
        oracles.on_fabric("agent.destroy", f)


def _crash(oracles: Oracles, history: History, f: dict[str, Any]) -> None:
    info = f.get("crash")  # the chain and the frames (sim.crash.describe), sent by the rank as data
    message = f"{f['thread']} (pid {f['pid']}): {f['type']}: {f['error']}"
    if info and len(info["chain"]) > 1:
        root = info["chain"][-1]
        message += f" <- {root['type']}: {root['message']}"
    # Only torch.distributed's own errors: a strategy's exception that merely mentions gloo is a crash, as the
    # simulation (which matches on the exception's type) calls it.
    # A wrapper of the code under test around such an error (vLLM's "NIXL EPLB init failed: agents") is the same
    # failure: the chain's links are checked too.
    links = [(f["type"], f["error"])] + [(c["type"], c["message"]) for c in (info or {}).get("chain", [])[1:]]
    if any(t in COLLECTIVE_ERROR_TYPES and any(mark in m for mark in COLLECTIVE_FAILURE) for t, m in links):
        oracles.problems.append(Problem("liveness", "collective_timeout", message, len(history), history.now()))
    else:
        oracles.problems.append(Problem("crash", "exception", message, len(history), history.now(), info))
