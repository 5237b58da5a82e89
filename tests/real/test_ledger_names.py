"""The ledger of a real rank names peers as NIXL does: the bytes name that add_remote_agent returns, passed on to
prep_xfer_dlist, initialize_xfer and remove_remote_agent (as 1.5.1 allows), is the peer's str name in the ledger,
so a correct client is judged as correct.  Real agents, wrapped in this process."""

from __future__ import annotations

import itertools
import time

import pytest

from real_backends.judge import judge
from real_backends.ledger import LedgerAgent
from tests.conftest import real_nixl_or_skip


@pytest.fixture
def events(monkeypatch):
    api, _, _ = real_nixl_or_skip()
    seen: list = []
    seq = itertools.count()
    monkeypatch.setattr(LedgerAgent, "_real", api.nixl_agent)
    monkeypatch.setattr(
        LedgerAgent, "_emit", staticmethod(lambda kind, **f: seen.append((time.monotonic(), 0, next(seq), kind, f)))
    )
    monkeypatch.setattr(LedgerAgent, "_pid", 0)
    return seen


def _done(agent, handle) -> str:
    state = agent.transfer(handle)
    deadline = time.monotonic() + 10
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
        state = agent.check_xfer_state(handle)
    return state


def test_the_bytes_name_from_add_remote_agent_is_the_peers_name_in_the_ledger(events):
    import torch

    t0 = time.monotonic()
    src, dst = torch.arange(256, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)
    a, b = LedgerAgent("ledger-names-a"), LedgerAgent(b"ledger-names-b")  # 1.5.1 takes a bytes agent name too
    a.register_memory([src])
    b.register_memory([dst])
    name = b.add_remote_agent(a.get_agent_metadata())
    assert name == b"ledger-names-a"
    local = b.prep_xfer_dlist("NIXL_INIT_AGENT", [dst[:128]])
    remote = b.prep_xfer_dlist(name, [src[:128]])
    prepped = b.make_prepped_xfer("READ", local, [0], remote, [0])
    assert _done(b, prepped) == "DONE"
    direct = b.initialize_xfer("READ", b.get_xfer_descs([dst[128:]]), b.get_xfer_descs([src[128:]]), name)
    assert _done(b, direct) == "DONE"
    assert torch.equal(src, dst)
    for handle in (prepped, direct):
        b.release_xfer_handle(handle)
    for handle in (local, remote):
        b.release_dlist_handle(handle)
    b.remove_remote_agent(name)
    assert not b.check_remote_metadata("ledger-names-a")
    del a, b, prepped, direct, local, remote

    kinds = [kind for _, _, _, kind, _ in events]
    assert kinds.count("xfer.done") == 2 and kinds.count("agent.destroy") == 2
    assert {f["agent"] for *_, _, f in events} == {"ledger-names-a", "ledger-names-b"}
    # the load, two posts, two completions and the removal
    assert [f["peer"] for *_, _, f in events if "peer" in f] == ["ledger-names-a"] * 6
    _, oracles = judge(events, t0, completed=True, stuck=[])
    assert oracles.verdict() == ("pass", None, None)
    assert oracles.metrics["transfers"] == 2 and oracles.metrics["bytes_moved"] == 256
    assert not any(oracles.model.peers.values())  # the removal removed the peer the load added
