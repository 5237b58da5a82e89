"""ChildPlayer: programs played in a child process; a death there is an observation, not the test worker's end."""

from __future__ import annotations

import os
import signal
import time

import pytest

from real_backends.isolated import ChildPlayer
from tests.conftest import real_nixl_or_skip


def doubled(program, report) -> None:
    """Reports each step doubled; ``crash`` kills the child with SIGSEGV, ``hang`` outlasts any timeout, ``raise``
    is a broken play function."""
    for step in program:
        if step == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        if step == "hang":
            time.sleep(600)
        if step == "raise":
            raise ValueError("a broken play function")
        report(step * 2)


def post_released(program, report) -> None:
    """Real NIXL 1.5.1: a READ's steps, then the released request posted again (SIGSEGV: fact 22 of
    docs/reference/nixl-1.5.1.md)."""
    from fakes.conformance import nixl_cases
    from real_backends.nixl_real import RealBackend

    b = RealBackend()
    a, t, bb, u = nixl_cases._pair(b)
    h, _ = nixl_cases._read(b, bb, u, t)
    report(nixl_cases._finish(b, bb, h))
    report(h.release())
    report(bb.transfer(h))


@pytest.fixture
def player():
    p = ChildPlayer(f"{__name__}:doubled", step_timeout_s=20)
    yield p
    p.close()


def test_every_step_is_reported_and_the_child_serves_the_next_program(player) -> None:
    first = player.play([1, 2, 3])
    second = player.play(["a"])
    assert (first.steps, first.died) == ([2, 4, 6], None)
    assert (second.steps, second.died) == (["aa"], None)


def test_a_crash_keeps_the_finished_steps_and_names_the_signal_and_a_new_child_plays_on(player) -> None:
    crashed = player.play([1, 2, "crash", 4])
    assert (crashed.steps, crashed.died) == ([2, 4], "SIGSEGV")
    after = player.play([5])
    assert (after.steps, after.died) == ([10], None)


def test_a_hung_step_is_a_timeout_and_the_child_is_killed() -> None:
    p = ChildPlayer(f"{__name__}:doubled", step_timeout_s=1)
    try:
        hung = p.play([1, "hang"])
        assert (hung.steps, hung.died) == ([2], "timeout")
        assert p.play([3]).steps == [6]
    finally:
        p.close()


def test_a_broken_play_function_is_an_error_in_the_parent_not_an_observation(player) -> None:
    with pytest.raises(RuntimeError, match="a broken play function"):
        player.play([1, "raise"])
    assert player.play([2]).steps == [4]


def test_a_real_nixl_crash_is_observed_in_the_child() -> None:
    real_nixl_or_skip()
    p = ChildPlayer(f"{__name__}:post_released")
    try:
        played = p.play(["go"])
    finally:
        p.close()
    assert (played.steps, played.died) == (["DONE", None], "SIGSEGV")
