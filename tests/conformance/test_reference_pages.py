"""The pages of docs/reference/ and the code that cites them stay in step.

docs/reference/nixl-1.5.1.md and the catalogue say the same thing about which case checks which fact: a case's
docstring names the facts it pins (``Fact 21: ...``, ``Facts 5 and 20: ...``, ``Fact 21-22: ...``), the page's
"Checked by" column lists cases by name; either side can be edited alone, so a fact a case pins lists that case,
and every case the page names exists.  For every page: its rows are numbered without a gap, every file it names
exists, and every "DeepEP fault N" or "vLLM fault N" cited in the repository is a row of its page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fakes.conformance.nixl_cases  # noqa: F401 - registers the NIXL cases
from fakes.conformance.catalogue import CASES

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs" / "reference").glob("*.md"))
PAGE = ROOT / "docs" / "reference" / "nixl-1.5.1.md"
CITED = {
    "DeepEP fault": ROOT / "docs" / "reference" / "deep-ep.md",
    "vLLM fault": ROOT / "docs" / "reference" / "vllm-eplb.md",
}
# "Fact 8", "Facts 5 and 20", "Fact 21-22", "Facts 4, 17-27": the numbers a docstring's first words name
_FACTS = re.compile(r"^Facts? (\d+(?:-\d+)?(?:(?:,| and|, and) \d+(?:-\d+)?)*)")


def _repository_texts() -> list[Path]:
    """The docs and the code that may cite a page."""
    code = (p for d in ("sim", "fakes", "real_backends", "benchmarks", "tests") for p in ROOT.glob(f"{d}/**/*.py"))
    return [*ROOT.glob("*.md"), *ROOT.glob("docs/**/*.md"), *code]


def _rows(page: Path = PAGE) -> dict[int, tuple[str, str]]:
    """A page's numbered table: number -> (its first column after the number, its last column)."""
    rows = {}
    for line in page.read_text().splitlines():
        m = re.match(r"^\| (\d+) \| (.*?) \|(?: .* \|)? (.*) \|$", line)
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


@pytest.mark.parametrize(
    "doc, facts",
    [
        ("Fact 8: x", {8}),
        ("Facts 5 and 20: x", {5, 20}),
        ("Fact 21-22: x", {21, 22}),
        ("Facts 4, 17-19 and 30: x", {4, 17, 18, 19, 30}),
        ("Fact 26 (tcp): x", {26}),
        ("Observed on 1.5.1: fact 3", set()),
    ],
)
def test_a_docstring_s_facts_are_read_as_written(doc, facts):
    assert pinned(doc) == facts


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_page_s_rows_are_numbered_one_to_n_without_a_gap(page):
    rows = _rows(page)
    assert rows and list(rows) == list(range(1, len(rows) + 1))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_file_a_page_names_exists(page):
    """Backticked repository paths (``sim/oracles.py``, ``tests/x.py::test_y``) and, for a test, the test."""
    missing = []
    for token in re.findall(r"`([^`\s]+)`", page.read_text()):
        path, _, test = token.partition("::")
        if not re.match(r"^(sim|fakes|real_backends|benchmarks|tests|docs|scenarios)/", path):
            continue
        if not (ROOT / path).exists():
            missing.append(token)
        elif test and not re.search(rf"^\s*def {re.escape(test.partition('[')[0])}\(", (ROOT / path).read_text(), re.M):
            missing.append(token)
    assert missing == []


def test_every_fault_cited_in_the_repository_is_a_row_of_its_page():
    cited = []
    for path in _repository_texts():
        for name, number in re.findall(r"(DeepEP fault|vLLM fault)s? (\d+)", path.read_text()):
            cited.append((name, int(number), path.relative_to(ROOT)))
    assert cited  # the code does cite them
    assert [c for c in cited if c[1] not in _rows(CITED[c[0]])] == []


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


def test_nothing_in_the_repository_points_outside_it_for_its_facts():
    """The facts behind the fakes live in docs/reference/, in the project's words; a path to notes beside the
    checkout would not exist for a user."""
    outside = "../" + "shared"  # (split, so that this file does not find itself)
    found = [str(p.relative_to(ROOT)) for p in _repository_texts() if outside in p.read_text()]
    assert found == []
