"""A real run's verdict against the placement of torchrun slots' clocks (real_backends/ordering.py): a READ that
completes close to its source's destruction, on two processes whose clocks are placed only to within a bound."""

from __future__ import annotations

import pytest

from real_backends.judge import judge
from real_backends.ordering import clock_sensitivity
from sim.run import Result
from sim.cli_run import summary

SRC, DST = 0, 1  # the READ's source process (on slot 0's clock) and reader (a slot on another host)


def read_then_destroy(gap_s: float) -> list:
    """The reader's READ from the source's registered memory completes ``gap_s`` before the source's agent is
    destroyed (as stamped on slot 0's clock)."""
    ledger = [
        (1.0, SRC, 1, "agent.create", {"conn": "c0", "agent": "eplb-0", "pid": SRC}),
        (1.0, SRC, 2, "register", {"conn": "c0", "agent": "eplb-0", "pid": SRC, "ranges": [(4096, 64)]}),
        (1.05, DST, 1, "agent.create", {"conn": "c1", "agent": "eplb-1", "pid": DST}),
        (1.05, DST, 2, "register", {"conn": "c1", "agent": "eplb-1", "pid": DST, "ranges": [(8192, 64)]}),
        (1.1, DST, 3, "peer.load", {"conn": "c1", "agent": "eplb-1", "pid": DST, "peer": "eplb-0"}),
        (
            2.0 - 1e-4,
            DST,
            4,
            "xfer.post",
            {"conn": "c1", "agent": "eplb-1", "pid": DST, "peer": "eplb-0", "op": "READ", "nbytes": 64},
        ),
        (
            2.0,
            DST,
            5,
            "xfer.done",
            {
                "conn": "c1",
                "agent": "eplb-1",
                "pid": DST,
                "peer": "eplb-0",
                "op": "READ",
                "local": [(8192, 64)],
                "remote": [(4096, 64)],
                "nbytes": 64,
            },
        ),
        (2.0 + gap_s, SRC, 3, "agent.destroy", {"conn": "c0", "agent": "eplb-0", "pid": SRC}),
    ]
    return ledger


def sensitivity(events, bounds, **kw):
    """The placements that change the verdict, each process on a clock of its own with the given bound."""
    found = clock_sensitivity(
        events, 0.0, completed=False, stuck=[], clocks={src: (f"host{src}", b) for src, b in bounds.items()}, **kw
    )
    return found.changed


def test_the_events_as_stamped_pass():
    assert judge(read_then_destroy(1e-3), 0.0, completed=False, stuck=[])[1].verdict()[0] == "pass"


def test_a_destruction_within_the_bounds_of_the_read_makes_the_verdict_depend_on_the_placement():
    found = sensitivity(read_then_destroy(1e-3), {DST: 2e-3})
    # The reader's clock placed later (just past the destruction, or at the end of its bound) puts its READ after
    # the destruction; placed earlier, nothing changes.
    assert found == ["pid 1 +2.000 ms: safety (unregistered_access)", "pid 1 +1.000 ms: safety (unregistered_access)"]


def test_bounds_of_two_hosts_add_up_when_shifted_against_each_other():
    """Each clock alone (1.5 ms) cannot bridge a 2 ms gap; the two at opposite ends of their bounds can."""
    found = sensitivity(read_then_destroy(2e-3), {SRC: 1.5e-3, DST: 1.5e-3})
    assert found[0] == "pid 0 -1.500 ms, pid 1 +1.500 ms: safety (unregistered_access)"
    assert all(line.endswith("safety (unregistered_access)") for line in found)


def test_a_swap_inside_the_bound_is_found_where_both_ends_pass():
    """The source deregisters the range the READ read and registers it again 1 ms later, both within the reader's
    bound.  At either end of the bound the READ lands before both or after both (pass); only a placement in between
    puts it in the gap."""
    events = read_then_destroy(5e-3)
    events += [
        (2.0005, SRC, 4, "deregister", {"conn": "c0", "agent": "eplb-0", "pid": SRC, "ranges": [(4096, 64)]}),
        (2.0015, SRC, 5, "register", {"conn": "c0", "agent": "eplb-0", "pid": SRC, "ranges": [(4096, 64)]}),
    ]
    events.sort(key=lambda e: e[0])
    assert judge(events, 0.0, completed=False, stuck=[])[1].verdict()[0] == "pass"
    found = clock_sensitivity(events, 0.0, completed=False, stuck=[], clocks={DST: ("elsewhere", 2e-3)})
    assert found.changed == ["pid 1 +0.500 ms: safety (unregistered_access)"]
    assert found.tried == found.placements == 4  # its two ends, and the two swaps (before each of the two records)


def test_processes_of_one_host_shift_together():
    """Two readers on one other host: one clock, one placement for both, named together."""
    events = read_then_destroy(1e-3)
    found = clock_sensitivity(
        events, 0.0, completed=False, stuck=[], clocks={DST: ("elsewhere", 2e-3), 7: ("elsewhere", 1e-3)}
    )
    assert found.changed[0] == "pids 1,7 +2.000 ms: safety (unregistered_access)"


def test_two_completed_transfers_are_not_a_swap_worth_judging():
    """Neither changes what the other checks: their order cannot change the verdict."""
    events = read_then_destroy(1.0)  # the destruction far away
    events.append(
        (
            2.0 + 1e-4,
            SRC,
            9,
            "xfer.done",
            {
                "conn": "c0",
                "agent": "eplb-0",
                "pid": SRC,
                "peer": "eplb-1",
                "op": "READ",
                "local": [(4096, 64)],
                "remote": [(8192, 64)],
                "nbytes": 64,
            },
        )
    )
    found = clock_sensitivity(events, 0.0, completed=False, stuck=[], clocks={DST: ("elsewhere", 2e-3)})
    assert (found.changed, found.tried, found.placements) == ([], 0, 0)


@pytest.mark.parametrize("bounds", [{DST: 2e-3}, {SRC: 1e-3, DST: 1e-3}, {DST: 0.0}, {}])
def test_a_gap_wider_than_the_bounds_is_not_in_question(bounds):
    assert sensitivity(read_then_destroy(5e-3), bounds) == []


def test_nothing_is_judged_again_when_no_two_processes_events_are_close(monkeypatch):
    import real_backends.ordering as ordering

    def no_judging(*args, **kwargs):
        raise AssertionError("judged again although no placement can reorder anything")

    monkeypatch.setattr(ordering, "judge", no_judging)
    assert sensitivity(read_then_destroy(5e-3), {DST: 2e-3}) == []


def test_a_failing_verdict_that_a_placement_would_clear_is_reported_too():
    """Stamped the other way round (the destruction first), the READ is a finding; a placement within the bound
    that puts the READ first clears it: that verdict rests on the placement as much as a pass would."""
    assert judge(read_then_destroy(-1e-3), 0.0, completed=False, stuck=[])[1].verdict()[:2] == (
        "safety",
        "unregistered_access",
    )
    assert sensitivity(read_then_destroy(-1e-3), {DST: 2e-3}) == ["pid 1 -2.000 ms: pass", "pid 1 -1.000 ms: pass"]


def test_placements_beyond_the_cap_are_counted_not_judged(monkeypatch):
    import real_backends.ordering as ordering

    monkeypatch.setattr(ordering, "MAX_JUDGINGS", 1)
    found = clock_sensitivity(
        read_then_destroy(1e-3), 0.0, completed=False, stuck=[], clocks={DST: ("elsewhere", 2e-3)}
    )
    assert (found.tried, found.placements) == (1, 3)


def _result(metrics) -> Result:
    return Result("pass", None, None, 0, "scale-up", "shared-agent", "real-cpu", "", 10, 1.0, 2.0, metrics=metrics)


def test_the_summary_names_the_bound_and_what_depends_on_it():
    none = summary(_result({"clock_bound_s": 0.0015, "clock_sensitive": [], "clock_placements": [0, 0]}))
    assert "to within 1.500 ms; no two hosts' checked events lie that close" in none
    held = summary(_result({"clock_bound_s": 0.0015, "clock_sensitive": [], "clock_placements": [4, 4]}))
    assert "the verdict holds under each of 4 placements that reorder the events" in held
    capped = summary(_result({"clock_bound_s": 0.0015, "clock_sensitive": [], "clock_placements": [400, 900]}))
    assert "each of 400 placements (of 900: the rest not judged)" in capped
    told = summary(
        _result(
            {
                "clock_bound_s": 0.002,
                "clock_placements": [3, 3],
                "clock_sensitive": ["pid 1 +2.000 ms: safety (unregistered_access)"],
            }
        )
    )
    assert (
        "the verdict DEPENDS on that placement (1 of 3 placements change it): with pid 1 +2.000 ms: safety "
        "(unregistered_access)"
    ) in told
    many = summary(
        _result(
            {
                "clock_bound_s": 30.0,
                "clock_placements": [5, 5],
                "clock_sensitive": [f"pid {p} +30000.000 ms: safety (x)" for p in range(5)],
            }
        )
    )
    assert many.endswith("with pid 2 +30000.000 ms: safety (x); and 2 more (metrics.clock_sensitive)")
    assert "slot 0's clock" not in summary(_result({}))
