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


def _kind_literals() -> list[tuple[str, str]]:
    """Every kind the code names as a literal: a record it makes (``record("k", ...)``, a rank's ``history("k")``,
    the fabric's and the ledger's ``emit``) or a kind it matches on (``kind == "k"``, ``kind in ("k", ...)``)."""
    import ast

    found = []
    for package in ("sim", "fakes", "real_backends"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                strings: list[ast.expr] = []
                if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
                    if node.func.attr in ("record", "history", "emit", "_emit", "add"):
                        strings = [node.args[0]]
                elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "kind":
                    for right in node.comparators:
                        strings += right.elts if isinstance(right, (ast.Tuple, ast.Set, ast.List)) else [right]
                for s in strings:
                    if isinstance(s, ast.Constant) and isinstance(s.value, str) and "." in s.value:
                        found.append((s.value, f"{path.relative_to(ROOT)}:{s.lineno}"))
    return found


def test_every_kind_the_code_makes_or_matches_on_is_listed() -> None:
    """A typo in a kind the oracles or the judge match on would make them skip the records silently. The fake
    fabric's and the real ledger's events are the NIXL kinds without their ``nixl.`` prefix (sim/records.py)."""
    literals = _kind_literals()
    assert len(literals) > 60  # the scan sees the code
    # Events that never reach a history: the fabric's memory.free (sim/records.py leaves it out) and a real rank's
    # eplb.move_loop (the judge turns it into a metric, as the simulation keeps it).
    not_recorded = {"memory.free", "eplb.move_loop"}
    unknown = [
        (k, where)
        for k, where in literals
        if k not in events.KINDS and f"nixl.{k}" not in events.KINDS and k not in not_recorded
    ]
    assert not unknown, unknown
