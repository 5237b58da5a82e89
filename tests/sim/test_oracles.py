"""Oracles that the built-in matrix never trips, shown on purpose-built worlds."""

from __future__ import annotations

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
        "A", "elastic-prepare@0", ["eplb-async@0"], 1)


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
    race = {"agent": "eplb-0-x", "pid": 0, "conn": "ucx://0/1/eplb-0-x", "thread": "gc-late@0",
            "others": ["eplb-async@0"], "open": 3}
    c.oracles.on_fabric("agent.threads", race)
    c.oracles.on_fabric("agent.threads", {**race, "thread": "worker@0"})  # the same agent again: one finding
    verdict, invariant, detail = c.oracles.verdict()
    assert (verdict, invariant) == ("safety", "agent_threads")
    assert detail == ("agent eplb-0-x (pid 0) was called on thread gc-late@0 while eplb-async@0 held 3 open "
                      "transfer request(s) on it")
    assert len(c.oracles.problems) == 1
    c.kernel.close()
