"""The code (the product, the benchmarks and the tests) passes ruff's linter (pyflakes, pycodestyle, bugbear; the
rules and their few exceptions are in pyproject.toml), is laid out as ruff's formatter lays it out, and passes mypy
(its settings are in pyproject.toml too): unused imports and names, undefined names, shadowed loop variables, a None
where a value is needed and the like fail the suite, as CI runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sim", "fakes", "real_backends", "benchmarks", "tests")


def test_ruff_finds_nothing() -> None:
    try:
        import ruff  # noqa: F401 - installed with the dev extra, as ./dev and CI install it
    except ImportError:
        pytest.skip("ruff is not installed (pip install -e '.[dev]', as ./dev does)")
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", *PACKAGES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_format_changes_nothing() -> None:
    """The code is laid out as ``ruff format`` lays it out (its settings are ruff's, in pyproject.toml): a change
    is read for what it does, not for how its author wraps lines."""
    try:
        import ruff  # noqa: F401 - installed with the dev extra, as ./dev and CI install it
    except ImportError:
        pytest.skip("ruff is not installed (pip install -e '.[dev]', as ./dev does)")
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *PACKAGES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_mypy_finds_nothing() -> None:
    try:
        import mypy  # noqa: F401 - installed with the dev extra, as ./dev and CI install it
    except ImportError:
        pytest.skip("mypy is not installed (pip install -e '.[dev]', as ./dev does)")
    # From a clean checkout (CI) it checks everything (the product, the benchmarks and the tests), about 50 s on 2
    # cores; its cache (.mypy_cache) makes a rerun after a small change take seconds.
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_product_does_not_import_the_benchmarks() -> None:
    """benchmarks/ measures the product and may import it; the product (sim, fakes, real_backends) never imports
    the harness that measures it. The one exception is ``epsim bench``, the benchmarks' front door."""
    import ast

    offenders = []
    for package in ("sim", "fakes", "real_backends"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if not node.level
                    else []
                )
                if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(offenders) <= 1 and all(o.startswith("sim/cli.py:") for o in offenders), offenders
