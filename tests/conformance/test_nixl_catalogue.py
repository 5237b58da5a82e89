"""Every behaviour of the catalogue (fakes/conformance/nixl_cases.py), for the fake and for the real NIXL.

The ``dram`` expectations are what real NIXL 1.5.1 does on host memory: the real parameter checks that they are
still true, the fake parameter that the fake reproduces them.  Stricter profiles are checked on the fake only, case
by case, including every case where a profile deliberately differs from real DRAM.

The real side runs once for the module, through ``epsim conform --backend real --json`` as a user runs it: each
``test_behaviour[real-...]`` reads its case from that report, and the command itself is checked too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from fakes.conformance import CASES, matched_profile
from fakes.nixl.profiles import PROFILES
from real_backends.probe import judge, run_case
from tests.conftest import real_nixl_or_skip

STRICT = [p for p in PROFILES if p != "dram"]


@pytest.fixture(scope="module")
def conform_real() -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """``epsim conform --backend real --json`` on this machine: (the finished command, its report)."""
    real_nixl_or_skip()
    done = subprocess.run(
        [sys.executable, "-m", "sim.cli", "conform", "--backend", "real", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"epsim conform --backend real printed no report (exit {done.returncode}): {done.stderr[-2000:]}"
    return done, json.loads(lines[-1])


def test_conform_real_names_dram(conform_real) -> None:
    done, report = conform_real
    failed = [c for c in report["cases"] if c["outcome"] != "pass"]
    assert done.returncode == 0 and not failed, (failed, done.stderr[-2000:])
    assert report["matched_profile"] == "dram" and {c["name"] for c in report["cases"]} == set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_behaviour(name: str, nixl_impl: str, request) -> None:
    if nixl_impl == "real":
        case = next(c for c in request.getfixturevalue("conform_real")[1]["cases"] if c["name"] == name)
        result = judge(case, "dram", hardware=True)  # judged against dram whatever profile the report matched
    else:
        result = run_case(name, nixl_impl, "dram")
    if result["outcome"] == "skip":
        pytest.skip(result["reason"])
    assert result["outcome"] == "pass", (
        f"{nixl_impl} NIXL, case {name}: observed {result['observed']!r}, dram expects {result['expected']!r}\n"
        f"{CASES[name].doc}"
    )


@pytest.mark.parametrize("profile", STRICT)
@pytest.mark.parametrize("name", list(CASES))
def test_fake_profile(name: str, profile: str) -> None:
    result = run_case(name, "fake", profile)
    assert result["outcome"] == "pass", (
        f"fake NIXL in profile {profile}, case {name}: observed {result['observed']!r}, expected {result['expected']!r}"
    )


@pytest.mark.parametrize("profile", STRICT)
def test_every_strict_profile_says_where_it_differs(profile: str) -> None:
    differing = [n for n, c in CASES.items() if c.on_hardware(profile) != c.on_hardware("dram")]
    assert differing, f"profile {profile} claims no hardware difference from dram: real runs cannot tell it apart"
    assert PROFILES[profile].differs_from_dram, f"profile {profile} does not document what it changes"
    assert PROFILES[profile].evidence


@pytest.mark.parametrize("profile", list(PROFILES))
def test_fake_is_recognised_as_its_profile(profile: str) -> None:
    """Judged against every profile, the fake's observations in one profile match exactly that profile."""
    observed = {n: run_case(n, "fake", profile)["observed"] for n in CASES}
    assert matched_profile(observed, hardware=False) == profile


def test_catalogue_is_large_enough() -> None:
    assert len(CASES) >= 40
    families = {
        "register",
        "deregister",
        "metadata",
        "read",
        "write",
        "notif",
        "release",
        "remove",
        "destroyed",
        "two_process",
        "kill",
    }
    names = " ".join(CASES)
    assert all(f in names for f in families), sorted(f for f in families if f not in names)
