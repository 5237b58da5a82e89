"""The real cluster's wait for a command's answers when a rank has died (real_backends/cluster.py, ``join``).

No rank process is started: a bare cluster object with an inbox, and answers put into it from a thread, as the
ranks' reader threads do."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace
from typing import Any

from real_backends.cluster import Handle, RealCluster


def bare_cluster(pids: list[int], dead: set[int]) -> RealCluster:
    # Any: its engine (timeline) and its record below are duck-typed stand-ins, not the types the class declares
    cluster: Any = RealCluster.__new__(RealCluster)
    cluster.inbox = queue.Queue()
    cluster.crashed, cluster.stuck, cluster.events = [], [], []
    cluster.timeout_s = 30.0
    workers = {p: SimpleNamespace(alive=p not in dead, pending={}, clock_offset=0.0) for p in pids}
    cluster.timeline = SimpleNamespace(workers=workers)
    cluster.record = lambda kind, **fields: cluster.events.append((kind, fields))
    return cluster


def test_a_dead_rank_s_command_names_only_it_when_the_others_answer_just_after(monkeypatch):
    """The wait for the other ranks' answers, once a rank is seen dead, does not end at the first message of any
    kind, or an answer 50 ms away would be counted missing and its rank named as stuck.  (The settle is made long
    here, so that a loaded machine's scheduling cannot make the answer late.)"""
    monkeypatch.setattr("real_backends.cluster.SETTLE_S", 5.0)
    cluster = bare_cluster([0, 1, 2], dead={2})
    pending = {p: Handle(p, "rearrange") for p in (0, 1, 2)}
    for p in (0, 1, 2):
        cluster.timeline.workers[p].pending[7] = pending[p]

    def ranks_answer() -> None:
        cluster.inbox.put((0, ("event", 0.0, 0, 1, "eplb.moved", {})))  # an event first, then the answers
        cluster.inbox.put((0, ("done", 7, None)))
        time.sleep(0.05)
        cluster.inbox.put((1, ("done", 7, None)))

    answers = threading.Thread(target=ranks_answer)
    answers.start()
    started = time.monotonic()
    assert cluster.join(pending, "rearrange") is False
    answers.join()
    assert cluster.stuck == ["rearrange: pids [2] exited; waiting for pids [2]"]
    assert cluster.events[-1] == ("engine.stuck", {"what": "rearrange", "pids": [2]})
    assert time.monotonic() - started < 4  # ended when the living ranks had answered, not at the settle's end


def test_the_settle_ends_at_once_when_every_living_rank_has_answered(monkeypatch):
    monkeypatch.setattr("real_backends.cluster.SETTLE_S", 10.0)
    cluster = bare_cluster([0, 1], dead={1})
    pending = {0: Handle(0, "serve"), 1: Handle(1, "serve")}
    pending[0].event.set()
    started = time.monotonic()
    assert cluster.join(pending, "serve") is False
    assert time.monotonic() - started < 5
    assert cluster.stuck == ["serve: pids [1] exited; waiting for pids [1]"]
