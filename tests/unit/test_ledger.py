"""The real backend's ledger agent: every call into the agent notes a thread that races another's open transfers,
as the fake's agents do (not only transfer() and check_xfer_state())."""

from __future__ import annotations

import threading

import pytest

from real_backends.ledger import LedgerAgent


class _Descs:
    def __init__(self, spans):
        self._spans = spans

    def descCount(self) -> int:
        return len(self._spans)

    def __getitem__(self, i):
        return self._spans[i]


class _StuckAgent:
    """A stand-in for the real nixl_agent whose READ stays in PROC."""

    def __init__(self, *args, **kw) -> None:
        pass

    def transfer(self, handle, *args):
        return "PROC"

    def check_xfer_state(self, handle):
        return "PROC"

    def initialize_xfer(self, *args, **kw):
        return object()

    def register_memory(self, *args):
        return None

    def deregister_memory(self, *args):
        return None

    def remove_remote_agent(self, *args):
        return None

    def release_xfer_handle(self, *args):
        return None

    def get_agent_metadata(self):
        return b"md"

    def get_xfer_descs(self, *args):
        return _Descs([])


@pytest.fixture
def ledger(monkeypatch):
    events: list[tuple[str, dict]] = []
    monkeypatch.setattr(LedgerAgent, "_real", _StuckAgent)
    monkeypatch.setattr(LedgerAgent, "_emit", staticmethod(lambda kind, **f: events.append((kind, f))))
    monkeypatch.setattr(LedgerAgent, "_pid", 0)
    return events


@pytest.mark.parametrize(
    "call", ["deregister_memory", "remove_remote_agent", "release_xfer_handle", "get_agent_metadata"]
)
def test_any_call_from_another_thread_while_a_read_is_open_is_a_race(ledger, call) -> None:
    agent = LedgerAgent("x")
    descs = _Descs([(0x1000, 64)])
    agent.register_memory(descs)
    handle = agent.initialize_xfer("READ", descs, descs, "peer")
    posted = threading.Thread(target=lambda: agent.transfer(handle), name="eplb-async@0")
    posted.start()
    posted.join()
    args = {
        "deregister_memory": (descs,),
        "remove_remote_agent": ("peer",),
        "release_xfer_handle": (handle,),
        "get_agent_metadata": (),
    }[call]
    late = threading.Thread(target=lambda: getattr(agent, call)(*args), name="gc-late@0")
    late.start()
    late.join()
    races = [f for kind, f in ledger if kind == "agent.threads"]
    assert [(f["thread"], f["others"], f["open"]) for f in races] == [("gc-late@0", ["eplb-async@0"], 1)]


def test_descriptor_helpers_are_no_agent_call(ledger) -> None:
    agent = LedgerAgent("x")
    descs = _Descs([(0x1000, 64)])
    handle = agent.initialize_xfer("READ", descs, descs, "peer")
    posted = threading.Thread(target=lambda: agent.transfer(handle), name="eplb-async@0")
    posted.start()
    posted.join()
    agent.get_xfer_descs([])  # builds a list in Python, as the fake's get_xfer_descs does: not a racing call
    assert not [f for kind, f in ledger if kind == "agent.threads"]
