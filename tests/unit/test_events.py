"""The history's schema (sim/events.py): what it refuses, that checked runs report a record that is not its kind's,
and that docs/history.md is the schema rendered. The suite runs with EPSIM_CHECK_EVENTS=1 (tests/conftest.py), so
every run any test makes, simulated or real, checks each of its records."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim import events
from sim.errors import InternalError
from sim.run import run_scenario
from sim.scenario import load
from sim.trace import History

ROOT = Path(__file__).resolve().parents[2]


def test_the_reference_page_is_the_schema_rendered() -> None:
    page = ROOT / "docs" / "history.md"
    assert page.read_text() == events.render_reference(), (
        "docs/history.md is stale: python -c 'from sim import events; "
        'open("docs/history.md", "w").write(events.render_reference())\''
    )


def test_every_kind_has_a_meaning_and_plain_fields() -> None:
    for k in events.KINDS.values():
        assert k.doc, k.name
        assert k.worlds in ("both", "sim", "real"), k.name


@pytest.mark.parametrize(
    "kind, fields, why",
    [
        ("comm.swipe", {"pid": 1, "gen": "g"}, "unknown kind 'comm.swipe'"),
        ("comm.create", {"pid": 1, "gen": "g"}, "prev: Field required"),
        ("comm.create", {"pid": 1, "gen": "g", "prev": 1}, "prev: Input should be a valid boolean"),
        ("comm.create", {"pid": 1, "gen": "g", "prev": True, "by": "me"}, "by: Extra inputs are not permitted"),
        ("engine.members", {"group": "g", "members": [0, "1"]}, "members.1: Input should be a valid integer"),
    ],
)
def test_a_record_that_is_not_its_kind_s_is_named_with_the_field(kind, fields, why) -> None:
    with pytest.raises(events.UnknownEvent, match=why.replace("(", r"\(").replace(")", r"\)")):
        events.check(kind, fields)


def test_a_field_one_world_gives_is_optional_and_still_typed() -> None:
    events.check("process.kill", {"pid": 3, "threads": ["main@3"]})  # the simulation's
    events.check("process.kill", {"pid": 3, "signal": "SIGKILL"})  # a real run's
    with pytest.raises(events.UnknownEvent, match="signal"):
        events.check("process.kill", {"pid": 3, "signal": 9})


def test_a_checked_history_keeps_the_run_going_and_refuses_it_at_the_end(monkeypatch) -> None:
    monkeypatch.setenv("EPSIM_CHECK_EVENTS", "1")
    history = History(lambda: 0.0)
    history.record("comm.create", pid=0, gen="g", prev=False)
    history.record("comm.create", pid=0, gen="g")  # kept: the run is not disturbed where the record is made
    assert len(history) == 2
    with pytest.raises(InternalError, match="prev: Field required"):
        history.refuse_malformed()


def test_an_unchecked_history_takes_any_record(monkeypatch) -> None:
    monkeypatch.setenv("EPSIM_CHECK_EVENTS", "0")
    history = History(lambda: 0.0)
    history.record("anything.at_all", x=object())
    history.refuse_malformed()


def test_a_simulated_run_with_a_record_of_no_kind_is_an_internal_error(monkeypatch) -> None:
    """A run whose code records an event the schema does not list stops with epsim's internal error (exit 3), not
    with a verdict on the code under test."""
    monkeypatch.setenv("EPSIM_CHECK_EVENTS", "1")
    monkeypatch.setattr(events, "KINDS", {k: v for k, v in events.KINDS.items() if k != "comm.swap"})
    with pytest.raises(InternalError, match="unknown kind 'comm.swap'"):
        run_scenario(load("scale-up"))
