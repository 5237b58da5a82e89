"""docs/reference/nixl-1.5.1.md and the catalogue say the same thing about which case checks which fact.

A case's docstring names the facts it pins (``Fact 21: ...``, ``Facts 5 and 20: ...``, ``Fact 21-22: ...``); the
page's "Checked by" column lists cases by name.  Either side can be edited alone, so this keeps them in step: a
fact a case pins lists that case, and every case the page names exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fakes.conformance.nixl_cases  # noqa: F401 - registers the NIXL cases
from fakes.conformance.catalogue import CASES

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "nixl-1.5.1.md"
# "Fact 8", "Facts 5 and 20", "Fact 21-22", "Facts 4, 17-27": the numbers a docstring's first words name
_FACTS = re.compile(r"^Facts? (\d+(?:-\d+)?(?:(?:,| and|, and) \d+(?:-\d+)?)*)")


def _rows() -> dict[int, tuple[str, str]]:
    """The page's facts table: number -> (fact, checked by)."""
    rows = {}
    for line in PAGE.read_text().splitlines():
        m = re.match(r"^\| (\d+) \| (.*) \| (.*) \|$", line)
        if m:
            rows[int(m[1])] = (m[2], m[3])
    return rows


def pinned(doc: str) -> set[int]:
    """The fact numbers a docstring names at its start (empty if it names none)."""
    m = _FACTS.match(doc)
    if m is None:
        return set()
    numbers: set[int] = set()
    for part in re.split(r",? and |, ", m[1]):
        first, _, last = part.partition("-")
        numbers.update(range(int(first), int(last or first) + 1))
    return numbers


@pytest.mark.parametrize("doc, facts", [("Fact 8: x", {8}), ("Facts 5 and 20: x", {5, 20}),
                                        ("Fact 21-22: x", {21, 22}), ("Facts 4, 17-19 and 30: x", {4, 17, 18, 19, 30}),
                                        ("Fact 26 (tcp): x", {26}), ("Observed on 1.5.1: fact 3", set())])
def test_a_docstring_s_facts_are_read_as_written(doc, facts):
    assert pinned(doc) == facts


def test_the_facts_are_numbered_one_to_n_without_a_gap():
    assert list(_rows()) == list(range(1, len(_rows()) + 1))


def test_every_case_the_page_names_exists():
    named = {name for _, checked in _rows().values() for name in re.findall(r"`([^`]+)`", checked)}
    assert named and sorted(named - set(CASES)) == []


def test_a_fact_a_case_pins_lists_that_case():
    rows = _rows()
    missing = []
    for name, case in CASES.items():
        for fact in sorted(pinned(case.doc)):
            assert fact in rows, f"{name} pins fact {fact}, which the page does not have"
            if f"`{name}`" not in rows[fact][1]:
                missing.append(f"fact {fact}: {name}")
    assert missing == []


def test_most_facts_are_checked_by_a_case():
    """A fact with no case says what its evidence is instead; that stays the exception."""
    without = [n for n, (_, checked) in _rows().items() if "`" not in checked]
    assert len(without) <= 4, without
