"""``epsim conform`` keeps what a dying catalogue process already observed (sim/conform.py).

Real NIXL 1.5.1 crashed a process once in thousands of runs of an ordinary call sequence; the catalogue runs 63
cases in one child, so one such crash used to cost the whole report ("produced no result"), and in CI every real
parameter of the catalogue test with it.  The child here is tests/unit/dying_probe.py, which dies on purpose.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from fakes.conformance import CASES
from sim import conform
from sim.errors import BackendUnavailable

VICTIM = list(CASES)[10]
DYING = (sys.executable, "-m", "tests.unit.dying_probe")


@pytest.fixture
def dies(monkeypatch, tmp_path):
    """Arm the dying probe; returns the file that logs every case as it runs."""

    def arm(deaths: int, victim: str = VICTIM, how: str = "segv", where: str = "case"):
        for key, value in {
            "DIE_IN": victim,
            "DEATHS": str(deaths),
            "DEATH_COUNT": str(tmp_path / "deaths"),
            "DIE_HOW": how,
            "DIE_WHERE": where,
            "RUN_LOG": str(tmp_path / "ran"),
        }.items():
            monkeypatch.setenv(f"EPSIM_TEST_{key}", value)
        return tmp_path / "ran"

    return arm


def test_one_death_keeps_what_was_observed_and_reruns_only_that_case(dies):
    ran = dies(1)
    report = conform.run("fake", None, "dram", probe=DYING)
    assert [c["name"] for c in report["cases"]] == list(CASES)
    assert {c["outcome"] for c in report["cases"]} == {"pass"} and report["matched_profile"] == "dram"
    assert report["notes"] == [
        f"{VICTIM}: the catalogue's process died in it (SIGSEGV); it runs again alone, and "
        "the cases after it in a fresh process"
    ]
    # the cases before the death were not run again: only the victim ran twice
    assert Counter(ran.read_text().split()) == {**{name: 1 for name in CASES}, VICTIM: 2}


def test_a_case_whose_process_dies_twice_observes_the_death(dies):
    dies(2)
    report = conform.run("fake", None, "dram", probe=DYING)
    by_name = {c["name"]: c for c in report["cases"]}
    assert by_name[VICTIM]["observed"] == "SIGSEGV" and by_name[VICTIM]["outcome"] == "fail"
    assert all(c["outcome"] == "pass" for name, c in by_name.items() if name != VICTIM)
    assert len(by_name) == len(CASES) and len(report["notes"]) == 2
    assert report["notes"][1] == f"{VICTIM}: its process died again in it, run alone (SIGSEGV); that is its observation"


def test_an_exit_without_a_signal_is_observed_by_its_status_and_quoted_in_the_note(dies):
    dies(2, how="exit5")
    report = conform.run("fake", None, "dram", probe=DYING)
    by_name = {c["name"]: c for c in report["cases"]}
    # the observation is the status alone (repeatable); the child's last words go in the note
    assert by_name[VICTIM]["observed"] == "exit 5"
    assert report["notes"][1] == (
        f"{VICTIM}: its process died again in it, run alone (exit 5: [host:1234] boom); that is its observation"
    )


def test_a_fresh_process_that_dies_before_its_first_case_keeps_the_earlier_results(dies):
    """The run-alone process dies while it starts: counted against the case it was started for."""
    ran = dies(2, where="case,start")
    report = conform.run("fake", None, "dram", probe=DYING)
    by_name = {c["name"]: c for c in report["cases"]}
    assert by_name[VICTIM]["observed"] == "SIGSEGV" and len(by_name) == len(CASES)
    assert report["notes"][1] == (
        f"{VICTIM}: its process died again before it started, run alone (SIGSEGV); that is its observation"
    )
    assert Counter(ran.read_text().split()) == {name: 1 for name in CASES}


def test_a_process_that_dies_before_any_case_is_one_error(dies):
    dies(1, victim=list(CASES)[0], where="start")
    with pytest.raises(BackendUnavailable, match="^the conformance run on fake NIXL produced no result: SIGSEGV$"):
        conform.run("fake", None, "dram", probe=DYING)


def test_a_case_that_hangs_is_killed_and_counts_as_a_death(dies):
    # The bound leaves every other case room on a loaded 2-core machine (a fake case takes well under a second
    # alone; 3 s was once too little for one of them beside the rest of the suite).
    dies(2, how="hang")
    report = conform.run("fake", None, "dram", probe=DYING, case_timeout_s=8)
    by_name = {c["name"]: c for c in report["cases"]}
    assert by_name[VICTIM]["observed"] == "no answer within 8 s, killed" and by_name[VICTIM]["outcome"] == "fail"
    assert {name: c["observed"] for name, c in by_name.items() if name != VICTIM and c["outcome"] != "pass"} == {}
    assert report["notes"][0].startswith(f"{VICTIM}: the catalogue's process died in it (no answer within 8 s")


def test_a_slow_start_is_not_a_hang_in_the_first_case(dies):
    """The per-case bound starts at the child's first line: its imports and its backend's start have their own."""
    dies(1, victim=list(CASES)[0], how="slow", where="start")
    report = conform.run("fake", None, "dram", probe=DYING, case_timeout_s=10)  # the start takes 14 s
    assert {c["outcome"] for c in report["cases"]} == {"pass"} and report["notes"] == []


def test_a_start_that_never_ends_is_killed_after_its_own_bound(dies):
    dies(1, victim=list(CASES)[0], how="hang", where="start")
    with pytest.raises(
        BackendUnavailable, match="^the conformance run on fake NIXL produced no result: no answer within 2 s, killed$"
    ):
        conform.run("fake", None, "dram", probe=DYING, case_timeout_s=30, start_timeout_s=2)


def test_the_first_case_dying_again_at_start_is_its_observation_not_an_unavailable_backend(dies):
    """With nothing observed yet, the first case's run-alone process dying while it starts is that case's
    observation, not a backend that cannot run the catalogue at all."""
    first = list(CASES)[0]
    dies(2, victim=first, where="case,start-alone")
    report = conform.run("fake", None, "dram", probe=DYING)
    by_name = {c["name"]: c for c in report["cases"]}
    assert by_name[first]["observed"] == "SIGSEGV" and len(by_name) == len(CASES)
    assert all(c["outcome"] == "pass" for name, c in by_name.items() if name != first)


def test_lines_that_are_not_the_protocol_s_are_ignored():
    assert conform._ours('{"case": {"name": "' + VICTIM + '"}') is None  # cut short by a death
    assert conform._ours('{"level": "info"}') is None and conform._ours("[1] {") is None
    assert conform._ours('{"case": {"name": "not-a-case"}}') is None
    assert conform._ours('{"starting": "' + VICTIM + '"}') == {"starting": VICTIM}
    assert conform._ours('{"starting": "not-a-case"}') is None and conform._ours('{"starting": ["x"]}') is None


def test_a_clean_run_has_no_notes():
    report = conform.run("fake", None, "dram")
    assert report["notes"] == [] and report["matched_profile"] == "dram" and len(report["cases"]) == len(CASES)
