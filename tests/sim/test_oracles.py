"""Oracles that the built-in matrix never trips, shown on purpose-built worlds."""

from __future__ import annotations

import pytest
import torch

from fakes.nixl import FakeFabric, TimeModel, _api, use_fabric
from sim.kernel import Kernel


def _world():
    """A kernel and a simulated-time fabric that knows which simulated thread is calling; one agent A with a
    peer B to READ from, both in process 0 (two threads of one worker)."""
    k = Kernel(seed=0)
    fabric = FakeFabric("dram", clock=k.now, time_model=TimeModel(xfer_latency_s=1e-3))
    fabric.thread_of = k.current
    fabric.poll_wait = lambda due: k.sleep(max(due - k.now(), 1e-6), "polling")
    events = []
    fabric.listeners.append(lambda kind, fields: events.append((kind, fields)) if kind == "agent.threads" else None)
    with use_fabric(fabric):
        a, b = _api.nixl_agent("A"), _api.nixl_agent("B")
    src, dst = torch.ones(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    b.register_memory(src)
    a.register_memory(dst)
    a.add_remote_agent(b.get_agent_metadata())
    return k, a, b, src, dst, events


def _mover(a, src, dst, release_first: bool):
    def run() -> None:
        h = a.initialize_xfer("READ", a.get_xfer_descs(dst), a.get_xfer_descs(src), "B")
        a.transfer(h)
        while a.check_xfer_state(h) != "DONE":
            pass  # each PROC check sleeps the thread until the READ is due (fabric.poll_wait)
        if release_first:
            a.release_xfer_handle(h)
        return h

    return run


def test_an_agent_called_by_one_thread_while_another_has_a_read_open_is_reported() -> None:
    k, a, b, src, dst, events = _world()
    k.spawn("eplb-async@0", _mover(a, src, dst, release_first=False), pid=0)
    # Half a millisecond in, while the 1 ms READ is in flight:
    k.spawn("elastic-prepare@0", lambda: (k.sleep(5e-4), a.get_agent_metadata()), pid=0)
    k.run()
    assert len(events) == 1
    fields = events[0][1]
    assert (fields["agent"], fields["thread"], fields["others"], fields["open"]) == (
        "A",
        "elastic-prepare@0",
        ["eplb-async@0"],
        1,
    )


def test_the_same_calls_one_after_the_other_are_not_reported() -> None:
    k, a, b, src, dst, events = _world()
    mover = k.spawn("eplb-async@0", _mover(a, src, dst, release_first=True), pid=0)

    def later() -> None:
        k.wait(mover.done, "the move")
        a.get_agent_metadata()

    k.spawn("elastic-prepare@0", later, pid=0)
    k.run()
    assert events == [] and torch.equal(dst, src)


def test_the_oracle_turns_the_first_racing_call_per_agent_into_a_safety_verdict() -> None:
    from sim.cluster import Cluster
    from sim.scenario import load

    c = Cluster(load("steady"), seed=0, strategy="shared-agent", profile="dram")
    race = {
        "agent": "eplb-0-x",
        "pid": 0,
        "conn": "ucx://0/1/eplb-0-x",
        "thread": "gc-late@0",
        "others": ["eplb-async@0"],
        "open": 3,
    }
    c.oracles.on_fabric("agent.threads", race)
    c.oracles.on_fabric("agent.threads", {**race, "thread": "worker@0"})  # the same agent again: one finding
    verdict, invariant, detail = c.oracles.verdict()
    assert (verdict, invariant) == ("safety", "agent_threads")
    assert detail == (
        "agent eplb-0-x (pid 0) was called on thread gc-late@0 while eplb-async@0 held 3 open transfer request(s) on it"
    )
    assert len(c.oracles.problems) == 1
    c.kernel.close()


# -- strategies that break one rule each (tests/strategies/oracle_mutants.py; found missing by a mutation review) --
MUTANTS = "tests.strategies.oracle_mutants"


def _run(scenario: str, strategy: str, **overrides):
    from sim.run import run_scenario
    from sim.scenario import load, with_overrides

    sc = load(scenario)
    return run_scenario(with_overrides(sc, **overrides) if overrides else sc, strategy=f"{MUTANTS}:{strategy}")


def test_a_prepare_that_never_returns_is_a_liveness_failure_not_an_endless_run() -> None:
    r = _run("scale-up", "never_prepares")
    assert (r.verdict, r.invariant) == ("liveness", "stuck")
    assert r.detail == (
        "PREPARE did not finish within 661 s while the group served: pid 0: worker@0 blocked on "
        "waiting for the engine, elastic-prepare@0 blocked on time.sleep; pid 1: worker@1 blocked on "
        "waiting for the engine, elastic-prepare@1 blocked on time.sleep"
    )


def test_a_second_deregistration_of_a_released_range_breaks_the_ledger() -> None:
    """NIXL refuses it (NOT_FOUND, swallowed here), so nothing is harmed, but the range's owner is confused."""
    r = _run("steady", "deregisters_twice")
    assert (r.verdict, r.invariant) == ("safety", "released_twice")
    assert r.detail.endswith(
        "deregistered a range of 80 B again after releasing it: every registration is released exactly once"
    )


def test_an_exception_after_a_complete_cleanup_is_no_leak() -> None:
    """The exception is recorded without its traceback, whose frames held the finalizer's agent alive (a false
    leak before)."""
    from sim.cluster import Cluster
    from sim.scenario import load

    c = Cluster(load("scale-up"), seed=0, strategy=f"{MUTANTS}:raises_after_cleanup", profile="dram")
    c.run()
    errors = [f["error"] for _, kind, f in c.kernel.history.records if kind == "finalizer.error"]
    verdict = c.oracles.verdict()
    c.kernel.close()
    assert verdict == ("pass", None, None)
    assert errors and set(errors) == {"RuntimeError: noise after a complete cleanup"}


def test_stale_peers_are_judged_when_an_abort_completes() -> None:
    """Peers loaded at PREPARE (eagerly) and never removed: the abort's ranks are gone once it completes."""
    r = _run("abort", "loads_peers_eagerly", timeline=[{"at_step": 800, "kind": "abort", "to": 4}])
    assert (r.verdict, r.invariant) == ("safety", "stale_peer")
    assert r.detail.endswith("of departed pid 2 loaded after the reconfiguration to pids 0-1")


@pytest.mark.parametrize(
    "fault, after_exit",
    [("gc.cycle:rank=2", ["nixl.process.kill"]), ("gc.never:rank=2", ["nixl.agent.destroy", "nixl.process.kill"])],
)
def test_what_a_gc_fault_holds_for_a_process_that_left_is_never_finalized_in_the_run(fault, after_exit) -> None:
    """Rank 2 leaves on scale-down with its old communicator held by the fault.  A cycle is collected by the
    process's last collection at its exit, as a real process's (and the real backend's rank) is; what gc.never holds
    goes with the process, and its finalizer never acts for a process that no longer exists (a deregistration
    refused on its vanished agent, at the last collection)."""
    from sim.cluster import Cluster
    from sim.faults import parse
    from sim.scenario import load

    c = Cluster(load("scale-down"), seed=0, strategy="per-communicator-agent", profile="dram", faults=[parse(fault)])
    c.run()
    records = list(c.kernel.history.records)
    c.kernel.close()
    gone = max(i for i, (_, kind, f) in enumerate(records) if kind == "process.kill" and f["pid"] == 2)
    assert [kind for _, kind, f in records[gone + 1 :] if f.get("pid") == 2] == after_exit
    assert not any(kind in ("nixl.deregister.refused", "interpreter.shutdown") for _, kind, _ in records)
    if fault.startswith("gc.cycle"):
        exit_gc = next(i for i, (_, kind, f) in enumerate(records) if kind == "gc.collect" and f["reason"] == "exit@2")
        assert any(kind == "nixl.agent.destroy" and f.get("pid") == 2 for _, kind, f in records[exit_gc:gone])
    assert c.oracles.verdict() == ("pass", None, None)
