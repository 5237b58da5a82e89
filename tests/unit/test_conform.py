"""``epsim conform`` keeps what a dying catalogue process already observed (sim/conform.py).

Real NIXL 1.5.1 crashed a process once in thousands of runs of an ordinary call sequence; the catalogue runs 63
cases in one child, so one such crash used to cost the whole report ("produced no result"), and in CI every real
parameter of the catalogue test with it.
"""

from __future__ import annotations

import sys

import pytest

from fakes.conformance import CASES
from sim import conform

VICTIM = list(CASES)[10]
DYING = (sys.executable, "-m", "tests.unit.dying_probe")


@pytest.fixture
def dies_in(monkeypatch, tmp_path):
    def arm(deaths: int) -> None:
        monkeypatch.setenv("EPSIM_TEST_DIE_IN", VICTIM)
        monkeypatch.setenv("EPSIM_TEST_DEATHS", str(deaths))
        monkeypatch.setenv("EPSIM_TEST_DEATH_COUNT", str(tmp_path / "deaths"))
    return arm


def test_one_death_is_a_note_and_every_case_is_still_observed(dies_in):
    dies_in(1)
    report = conform.run("fake", None, "dram", probe=DYING)
    assert [c["name"] for c in report["cases"]] == list(CASES)
    assert {c["outcome"] for c in report["cases"]} == {"pass"} and report["matched_profile"] == "dram"
    assert report["notes"] == [f"{VICTIM}: the catalogue's process died in it (SIGSEGV); the case runs again "
                               "alone, and the cases after it in a fresh process"]


def test_a_case_whose_process_dies_twice_observes_the_death(dies_in):
    dies_in(2)
    report = conform.run("fake", None, "dram", probe=DYING)
    by_name = {c["name"]: c for c in report["cases"]}
    assert by_name[VICTIM]["observed"] == "SIGSEGV" and by_name[VICTIM]["outcome"] == "fail"
    assert all(c["outcome"] == "pass" for name, c in by_name.items() if name != VICTIM)
    assert len(by_name) == len(CASES) and len(report["notes"]) == 2
    assert report["notes"][1] == f"{VICTIM}: its process died again (SIGSEGV) when run alone; that is its observation"


def test_a_clean_run_has_no_notes():
    report = conform.run("fake", None, "dram")
    assert report["notes"] == [] and report["matched_profile"] == "dram" and len(report["cases"]) == len(CASES)
