"""The kernel: greenlet threads on a SimPy clock, seeded tie-breaks, crashes, kills, simulated time."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from sim.kernel import BlockingOutsideThread, Kernel


def test_threads_sleep_in_simulated_time_and_history_is_literal() -> None:
    k = Kernel(seed=1, tiebreak=False)
    log = []

    def worker(name: str, delays: list[float]) -> str:
        for d in delays:
            k.sleep(d)
            log.append((k.now(), name))
        return name

    a = k.spawn("a", worker, "a", [1.0, 2.0], pid=0)
    b = k.spawn("b", worker, "b", [2.5], pid=1)
    k.run()
    assert log == [(1.0, "a"), (2.5, "b"), (3.0, "a")]
    assert (a.state, a.result, b.result) == ("done", "a", "b")
    assert [(t, kind) for t, kind, _ in k.history.records] == [
        (0.0, "thread.start"),
        (0.0, "thread.start"),
        (2.5, "thread.end"),
        (3.0, "thread.end"),
    ]


def _interleaving(seed: int) -> list[str]:
    k = Kernel(seed=seed)
    order: list[str] = []

    def body(n: str) -> None:
        k.sleep(1.0)
        order.append(n)

    for name in "abcdef":
        k.spawn(name, body, name)
    k.run()
    return order


def test_same_time_events_follow_the_seed() -> None:
    assert _interleaving(3) == _interleaving(3)
    orders = {tuple(_interleaving(s)) for s in range(12)}
    assert len(orders) > 3, "tie-breaks do not depend on the seed"


def test_same_seed_same_trace_hash() -> None:
    def world(seed):
        k = Kernel(seed=seed)

        def body(i: int) -> None:
            for _ in range(3):
                k.sleep(0.5 * (i % 2))

        for i in range(4):
            k.spawn(f"t{i}", body, i, pid=i)
        k.run()
        return k.history.trace_hash()

    assert world(7) == world(7)


def test_trace_hash_depends_on_values_not_on_shared_objects() -> None:
    from sim.trace import History

    def hashed(*records):
        clock = [0.0]
        h = History(lambda: clock[0])
        for t, kind, fields in records:
            clock[0] = t
            h.record(kind, **fields)
        return h.trace_hash()

    name = "agent-" + str(7)  # one object, recorded twice below; a copy of it in the other history
    base = hashed((0.5, "a", {"agent": name, "spans": [(1, 2)]}), (1.0, "b", {"agent": name, "n": 3}))
    copied = "".join(name)  # equal, another object
    assert base == hashed((0.5, "a", {"agent": "agent-7", "spans": [(1, 2)]}), (1.0, "b", {"agent": copied, "n": 3}))
    changed = [
        hashed((0.5, "a", {"agent": name, "spans": [(1, 2)]}), (1.0, "b", {"agent": name, "n": 4})),
        hashed((0.5, "a", {"agent": name, "spans": [(1, 2)]}), (1.5, "b", {"agent": name, "n": 3})),
        hashed((0.5, "a", {"spans": [(1, 2)], "agent": name}), (1.0, "b", {"agent": name, "n": 3})),
        hashed((1.0, "b", {"agent": name, "n": 3}), (0.5, "a", {"agent": name, "spans": [(1, 2)]})),
        hashed((0.5, "a", {"agent": name, "spans": [(1, 2)]}), (1.0, "b", {"agent": name, "n": 3.0})),
    ]
    assert len({base, *changed}) == 6  # a value, a time, field order, record order, a type: each counts


def test_wait_returns_the_event_value_and_raises_its_failure() -> None:
    k = Kernel()
    ev_ok, ev_bad = k.env.event(), k.env.event()
    got = []

    def waiter():
        got.append(k.wait(ev_ok, "ok"))
        with pytest.raises(KeyError):
            k.wait(ev_bad, "bad")
        got.append("raised")

    def trigger():
        k.sleep(1)
        ev_ok.succeed(42)
        k.sleep(1)
        ev_bad.fail(KeyError("x"))

    k.spawn("w", waiter)
    k.spawn("t", trigger)
    k.run()
    assert got == [42, "raised"]


def test_wait_for_times_out_in_simulated_time() -> None:
    k = Kernel()
    never = k.env.event()
    out = []
    k.spawn("w", lambda: out.append((k.wait_for(never, 300.0, "barrier"), k.now())))
    k.run()
    assert out == [((False, None), 300.0)]


def test_an_exception_escaping_a_thread_is_a_crash_and_halts() -> None:
    k = Kernel()
    steps = []

    def bad():
        k.sleep(1)
        raise ValueError("boom")

    def long():
        for _ in range(10):
            k.sleep(1)
            steps.append(k.now())

    t = k.spawn("bad", bad, pid=2)
    k.spawn("long", long)
    k.run()
    assert t.state == "failed" and isinstance(t.exception, ValueError)
    assert [(th.name, str(e)) for th, e in k.crashes] == [("bad", "boom")]
    assert k.now() == 1.0 and max(steps, default=0) <= 1.0
    assert k.history.records[-1][1:] == ("thread.crash", {"thread": "bad", "pid": 2, "error": "ValueError: boom"})


def test_killed_process_never_runs_again() -> None:
    k = Kernel()
    ran = []

    def victim():
        try:
            k.sleep(5)
            ran.append("after")
        finally:
            ran.append("finally")

    def killer():
        k.sleep(1)
        k.kill_process(3)

    v = k.spawn("victim", victim, pid=3)
    k.spawn("killer", killer)
    k.run()
    assert v.state == "killed" and ran == []
    k.close()  # unwinding after the verdict is allowed
    assert ran == ["finally"]


def test_a_thread_that_kills_its_own_process_runs_no_further_line() -> None:
    # kill_process must not return to its caller, or the caller runs on to its next wait and is resumed from there
    # as if blocked.  SIGKILL of one's own process does not return.
    k = Kernel()
    ran = []

    def suicidal():
        k.sleep(1)
        k.kill_process(4)
        ran.append("after the kill")
        k.sleep(1)
        ran.append("resumed")

    def sibling():
        k.sleep(5)
        ran.append("sibling")

    def bystander():
        k.sleep(3)
        ran.append("bystander")

    me, sib = k.spawn("suicidal", suicidal, pid=4), k.spawn("sibling", sibling, pid=4)
    k.spawn("bystander", bystander, pid=5)
    k.run()
    assert ran == ["bystander"] and (me.state, sib.state) == ("killed", "killed")
    assert k.now() == 5.0  # the sibling's pending timer still fires, and runs nothing
    assert [f for _, kind, f in k.history.records if kind == "process.kill"] == [
        {"pid": 4, "threads": ["suicidal", "sibling"]}
    ]


def test_a_run_that_ends_before_its_until_does_not_halt_a_later_run() -> None:
    k = Kernel()
    ticks = []

    def ticker():
        while True:
            k.sleep(1)
            ticks.append(k.now())

    def stopper():
        k.sleep(2.5)
        k.halt()

    k.spawn("ticker", ticker)
    k.spawn("stopper", stopper)
    k.run(until=4.5)  # halted at 2.5 by the stopper
    assert k.now() == 2.5 and ticks == [1.0, 2.0]
    k.run(until=8.5)  # the first run's timer (4.5) must not end this one
    assert k.now() == 8.5 and ticks == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]


def test_stuck_threads_are_reported_blocked() -> None:
    k = Kernel()
    never = k.env.event()
    th = k.spawn("stuck", lambda: k.wait(never, "all_gather_object on group eplb#1"))
    k.run()
    assert k.blocked() == [th]
    assert "all_gather_object" in repr(th)


def test_blocking_outside_a_thread_is_refused() -> None:
    k = Kernel()
    with pytest.raises(BlockingOutsideThread):
        k.sleep(1)


def test_time_and_uuid_are_simulated_inside_threads_only() -> None:
    k = Kernel(seed=5)
    seen: dict[str, Any] = {}

    def body():
        t0 = time.monotonic()
        time.sleep(2.5)
        seen["dt"] = time.monotonic() - t0
        seen["uuid"] = uuid.uuid4()

    k.spawn("t", body)
    before = time.monotonic()
    k.run()
    assert seen["dt"] == pytest.approx(2.5)
    assert time.monotonic() - before < 2.0  # no wall-clock sleep
    k2 = Kernel(seed=5)
    k2.spawn("t", lambda: seen.setdefault("uuid2", uuid.uuid4()))
    k2.run()
    assert seen["uuid"] == seen["uuid2"] and seen["uuid"].version == 4
    assert uuid.uuid4() != seen["uuid"]  # restored


def test_spawn_from_a_thread_and_join_by_waiting() -> None:
    k = Kernel()
    out = []

    def parent():
        def child_body() -> str:
            k.sleep(2)
            return "result"

        child = k.spawn("child", child_body, pid=1)
        out.append(k.wait(child.done, "join"))
        out.append(k.now())

    k.spawn("parent", parent, pid=1)
    k.run()
    assert out == ["result", 2.0]


def test_ctrl_c_while_a_thread_runs_interrupts_the_run_instead_of_being_its_crash() -> None:
    """SIGINT lands in whichever simulated thread runs at that moment; it is the user stopping epsim, so it leaves
    the run (the CLI says "interrupted", exit 130) instead of becoming a crash verdict (on which replay would say
    NOT reproduced and shrink would go on with a wrong result)."""
    k = Kernel(seed=0)

    def body() -> None:
        k.sleep(1.0)
        raise KeyboardInterrupt

    k.spawn("worker", body)
    with pytest.raises(KeyboardInterrupt):
        k.run()
    assert k.crashes == []


def test_another_simpy_is_refused_in_one_line(monkeypatch) -> None:
    """The kernel writes SimPy 4.1's event heap: a SimPy without it (or of another series) is a clear error."""
    import simpy

    from sim import kernel as kernel_mod
    from sim.errors import BackendUnavailable

    monkeypatch.setattr(kernel_mod, "_simpy_checked", False)
    monkeypatch.setattr(simpy, "__version__", "5.0.0")
    with pytest.raises(BackendUnavailable, match=r"simpy 5.0.0 is installed; .*pip install 'simpy>=4.1,<4.2'"):
        kernel_mod.Kernel(0)
    monkeypatch.undo()
    kernel_mod.Kernel(0)  # the tested SimPy


def test_a_wait_that_holds_the_gil_stops_the_processs_other_threads_only() -> None:
    k = Kernel(tiebreak=False)
    log: list[tuple[float, str]] = []
    done = k.env.event()

    def holder() -> None:
        k.sleep(0.5)
        k.wait(done, "a native barrier", holds_gil=True)
        log.append((k.now(), "holder"))

    def ticker(name: str) -> None:
        for _ in range(3):
            k.sleep(1.0)
            log.append((k.now(), name))

    def releaser() -> None:
        k.sleep(2.5)
        done.succeed()

    k.spawn("holder", holder, pid=0)
    same = k.spawn("same-process", ticker, "same", pid=0)
    k.spawn("other-process", ticker, "other", pid=1)
    k.spawn("releaser", releaser, pid=2)
    probe: list[str] = []
    k.env.timeout(1.5).callbacks.append(lambda _e: probe.append(same.blocked_on))
    k.run()
    # Process 1 ticks on; process 0's ticker wakes at 1.0 and waits for the lock until the barrier returns at 2.5,
    # then goes on from there.
    assert log == [
        (1.0, "other"),
        (2.0, "other"),
        (2.5, "holder"),
        (2.5, "same"),
        (3.0, "other"),
        (3.5, "same"),
        (4.5, "same"),
    ]
    assert probe == ["the GIL (holder holds it in a native barrier)"]


def test_a_killed_holder_leaves_nothing_parked() -> None:
    k = Kernel(tiebreak=False)
    ran: list[str] = []

    def holder() -> None:
        k.wait(k.env.event(), "a barrier nobody reaches", holds_gil=True)

    def sleeper() -> None:
        k.sleep(1.0)
        ran.append("sleeper")

    def killer() -> None:
        k.sleep(2.0)
        k.kill_process(0)
        k.spawn("after", lambda: ran.append("new thread"), pid=0)

    k.spawn("holder", holder, pid=0)
    k.spawn("sleeper", sleeper, pid=0)
    k.spawn("killer", killer, pid=1)
    k.run()
    assert ran == ["new thread"]  # the parked sleeper died with its process; pid 0's GIL is free again
    k.close()
