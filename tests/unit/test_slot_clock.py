"""How a torchrun slot's events are put on slot 0's clock (real_backends/launch.py).

A slot on slot 0's kernel reads the same monotonic clock and gets no correction; measuring one message's latency as
an "offset" there shifted a loaded host's ranks apart by milliseconds, and the judge then saw a peer's READ land
after its source was destroyed (a false unregistered_access under torchrun).  A slot on another kernel gets an
offset from request-reply rounds, correct to within the bound it reports.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from multiprocessing import Pipe

import pytest

from real_backends.launch import answer_clock, clock_domain, measure_clock_offset, place_clock, receive_hello
from sim.errors import ScenarioError


def test_processes_of_one_kernel_share_a_clock_domain():
    here = clock_domain()
    assert here is not None and here.count("/") == 1  # boot id / time namespace
    child = subprocess.run([sys.executable, "-c", "from real_backends.launch import clock_domain; "
                            "print(clock_domain())"], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == here


def _slot(conn, clock, answered: list) -> None:
    """A slot that answers clock requests, then records the message that ended them."""
    answered.append(answer_clock(conn, clock))


def test_a_slot_on_this_kernel_is_not_corrected_and_not_asked():
    ours, theirs = Pipe()
    answered: list = []
    slot = threading.Thread(target=_slot, args=(theirs, time.monotonic, answered))
    slot.start()
    info = {"clock_domain": clock_domain()}
    place_clock(ours, info)
    ours.send(("done",))
    slot.join(10)
    assert (info["clock_offset"], info["clock_bound"]) == (0.0, 0.0)
    assert answered == [("done",)]  # the first message it saw was the end: no clock round was needed


def test_a_slot_on_another_kernel_gets_its_offset_within_the_bound_it_reports():
    skew = 1234.5  # the other host's monotonic clock runs this far ahead of ours
    for domain in ("another-boot/time:[1]", None):  # a different kernel, or one that cannot say
        ours, theirs = Pipe()
        answered: list = []
        slot = threading.Thread(target=_slot, args=(theirs, lambda: time.monotonic() + skew, answered))
        slot.start()
        info = {"clock_domain": domain}
        place_clock(ours, info)
        ours.send(("config", "x"))
        slot.join(10)
        assert answered == [("config", "x")]
        # its reading was taken inside the round trip, so the estimate is off by at most half of it
        assert abs(info["clock_offset"] + skew) <= info["clock_bound"] + 1e-6
        assert 0.0 < info["clock_bound"] < 1.0


def test_the_shortest_round_sets_the_estimate():
    """A round slowed by the host (here: the slot's first answer is late) does not spoil the estimate."""
    ours, theirs = Pipe()
    late = [True]

    def clock() -> float:
        if late[0]:
            late[0] = False
            time.sleep(0.2)
        return time.monotonic()

    slot = threading.Thread(target=_slot, args=(theirs, clock, []))
    slot.start()
    offset, bound = measure_clock_offset(ours, rounds=4)
    ours.send(("done",))
    slot.join(10)
    assert bound < 0.1 and abs(offset) <= bound + 1e-6


def test_a_closed_connection_ends_the_slot_s_wait():
    ours, theirs = Pipe()
    ours.close()
    assert answer_clock(theirs) is None


def test_a_hello_is_received_and_placed():
    ours, theirs = Pipe()
    answered: list = []
    theirs.send({"rank": 3, "host": "h", "clock_domain": clock_domain()})
    slot = threading.Thread(target=_slot, args=(theirs, time.monotonic, answered))
    slot.start()
    info = receive_hello(ours, timeout_s=10)
    ours.send(("done",))
    slot.join(10)
    assert info == {"rank": 3, "host": "h", "clock_domain": clock_domain(), "clock_offset": 0.0, "clock_bound": 0.0}


def test_a_slot_of_an_older_epsim_is_refused_in_one_line():
    """Its hello has no clock domain: it cannot answer clock requests, and placing it by its hello's latency is what
    gave the false verdicts this scheme replaced."""
    ours, theirs = Pipe()
    theirs.send({"rank": 2, "local_rank": 0, "host": "h", "os_pid": 1})
    with pytest.raises(ScenarioError, match=r"^torchrun slot 2 runs another version of epsim .*same epsim$"):
        receive_hello(ours, timeout_s=10)


@pytest.mark.parametrize("how", ["closes before its hello", "stalls before its hello", "dies during the rounds",
                                 "stalls during the rounds"])
def test_a_slot_that_dies_or_stalls_before_it_is_placed_is_dropped(how):
    ours, theirs = Pipe()
    if "rounds" in how:  # on another kernel, so the rounds are needed
        theirs.send({"rank": 1, "host": "elsewhere", "clock_domain": "another-boot/time:[1]"})
    if "dies" in how or "closes" in how:
        theirs.close()
    started = time.monotonic()
    assert receive_hello(ours, timeout_s=0.2) is None
    assert time.monotonic() - started < 5
