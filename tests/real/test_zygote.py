"""Rank processes forked from the run's zygote (real_backends/zygote.py), or fresh interpreters where it cannot be
used: the same run either way, and the cluster sees every exit, kill and death as it does for a child of its own."""

from __future__ import annotations

import json
import os
import signal
import socket
from multiprocessing.connection import Connection

import pytest

from real_backends import launch
from tests.conftest import epsim, epsim_here, real_nixl_or_skip, started_as
from tests.real.test_no_leftovers import living, wait_gone
from tests.real.test_real_runs import LEDGER


@pytest.fixture(autouse=True)
def _rank_env(monkeypatch):
    real_nixl_or_skip()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what the real cluster sets for its ranks (and their zygote)
    monkeypatch.delenv("EPSIM_RANK_ZYGOTE", raising=False)


def _fork(zygote: launch._Zygote) -> tuple[Connection, launch._Forked]:
    mine, theirs = socket.socketpair()
    pid = zygote.fork(theirs.fileno())
    theirs.close()
    assert pid is not None
    return Connection(mine.detach()), launch._Forked(zygote, pid)


def test_the_zygote_forks_ranks_and_reports_their_exits_kills_and_its_own_death():
    zygote = launch._Zygote(launch.child_env())
    try:
        assert zygote.wait_ready(), zygote.why
        # A rank whose run goes away before sending its configuration ends with an error, as a fresh one would.
        conn, quits = _fork(zygote)
        assert quits.is_alive() and os.getppid() != quits.pid
        conn.close()
        quits.join(30)
        assert quits.exitcode not in (None, 0, -signal.SIGKILL)
        # kill() is a SIGKILL, reported as Popen.returncode reports one.
        conn, killed = _fork(zygote)
        killed.kill()
        killed.join(30)
        assert killed.exitcode == -signal.SIGKILL and not living(killed.pid)
        conn.close()
        # A zygote that dies takes its ranks with it, and they read as killed.
        conn, orphan = _fork(zygote)
        assert zygote.popen is not None  # it started (wait_ready above)
        os.kill(zygote.popen.pid, signal.SIGKILL)
        orphan.join(30)
        assert orphan.exitcode == -signal.SIGKILL
        assert wait_gone({orphan.pid, zygote.popen.pid}, 10.0) == set()
        conn.close()
    finally:
        zygote.close()


def test_a_zygote_with_a_second_thread_refuses_to_fork_and_says_why(monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")  # numpy's OpenBLAS starts a thread when it loads
    zygote = launch._Zygote(launch.child_env())
    try:
        assert not zygote.wait_ready()
        assert zygote.why == "2 threads after the imports (forking is safe with one)"
    finally:
        zygote.close()


def test_fresh_interpreters_where_the_zygote_cannot_be_used_run_the_same_run(monkeypatch, tmp_path):
    """Every other real run of the suite forks its ranks (tests/real/test_no_leftovers.py checks the history says
    so); this one's zygote has a second thread, so it starts fresh interpreters, and agrees with the simulation as
    the forked ones do."""
    args = ("scale-up", "--set", "timeline.0.to=3", "--set", "max_ranks=3", "--json")
    sim = json.loads(epsim_here("run", *args).stdout.strip().splitlines()[-1])
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    done = epsim("run", *args, "--backend", "real", "--out", str(tmp_path))
    real = json.loads(done.stdout.strip().splitlines()[-1])
    assert real["verdict"] == sim["verdict"] == "pass", real["detail"]
    assert {k: real["metrics"][k] for k in LEDGER} == {k: sim["metrics"][k] for k in LEDGER}
    assert started_as(tmp_path) == ["interpreter"] * 3


def test_epsim_rank_zygote_0_asks_for_fresh_interpreters(monkeypatch):
    from real_backends import zygote

    assert zygote.wanted()
    monkeypatch.setenv(zygote.ENV, "0")
    assert not zygote.wanted()
    assert launch.LocalLauncher()._zygote() is None
