"""The code passes ruff (pyflakes, pycodestyle, bugbear; the rules and their few exceptions are in pyproject.toml):
unused imports and names, undefined names, shadowed loop variables and the like fail the suite, as CI runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing() -> None:
    try:
        import ruff  # noqa: F401 - installed with the dev extra, as ./dev and CI install it
    except ImportError:
        pytest.skip("ruff is not installed (pip install -e '.[dev]', as ./dev does)")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "sim", "fakes", "real_backends", "benchmarks",
                           "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
