"""The DeepEP catalogue (fakes/conformance/deep_ep_cases.py), for the fake and for a real DeepEP.

The expectations are what DeepEP v1.2.1 does. The fake side runs everywhere. The real side needs a DeepEP build and
a GPU (marker ``gpu``); it runs once for the module, through ``epsim conform --library deep_ep --backend real
--json`` as a user runs it, with the build's module named by ``EPSIM_DEEP_EP`` (default ``deep_ep``).
docs/gpu-validation.md says how to build one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from fakes.conformance.deep_ep_cases import CASES
from real_backends.deep_ep_probe import run_case, unavailable

MODULE = os.environ.get("EPSIM_DEEP_EP", "deep_ep")


@pytest.fixture(scope="module")
def real_report() -> dict[str, Any]:
    if why := unavailable(MODULE):
        pytest.skip(why)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sim.cli",
            "conform",
            "--library",
            "deep_ep",
            "--backend",
            "real",
            "--deep-ep-module",
            MODULE,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"epsim conform --library deep_ep printed no report (exit {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("impl", ["fake", pytest.param("real", marks=pytest.mark.gpu)])
def test_behaviour(impl: str, name: str, request) -> None:
    if impl == "real":
        result = next(c for c in request.getfixturevalue("real_report")["cases"] if c["name"] == name)
    else:
        result = run_case(name, "fake")
    assert result["outcome"] == "pass", (
        f"{impl} DeepEP, case {name}: observed {result['observed']!r}, v1.2.1 does {result['expected']!r}\n"
        f"{CASES[name].doc}"
    )


def test_every_case_says_what_it_checks() -> None:
    for name, c in CASES.items():
        assert c.doc and c.ranks in (1, 2), name  # what one GPU holds: docs/deep-ep-fake.md
