"""A sample of the strategy matrix in the default run: every scenario and strategy on two fake-NIXL profiles, no GC
fault, checked against the rows of ``docs/results.md``, and the same sample under async EPLB.  The whole matrix
(every GC fault, the DeepEP, lifecycle and CUDA-stream tables, the file byte for byte) is
``tests/slow/test_matrix.py``, in the exhaustive run (``./dev test --slow``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.lab.matrix import MATRIX_STRATEGIES, SCENARIOS, run_matrix

DOC = Path(__file__).resolve().parents[2] / "docs" / "results.md"
PROFILES = ("dram", "rocm-strict")


@pytest.fixture(scope="module")
def cells():
    return run_matrix(profiles=PROFILES, faults=("",))


def documented() -> dict[tuple[str, str, str], tuple[str, str]]:
    """(scenario, strategy, profile) -> (the "no fault" cell, the duplicate registrations), for every row of the
    scenarios' tables in docs/results.md."""
    rows = {}
    for section in DOC.read_text().split("\n## ")[1:]:
        scenario, _, body = section.partition("\n")
        for line in body.splitlines():
            cols = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| ") and len(cols) > 3:
                rows[(scenario, cols[0], cols[1])] = (cols[2], cols[-1])
    return rows


def test_the_sampled_cells_are_the_documented_ones(cells) -> None:
    assert len(cells) == len(SCENARIOS) * len(MATRIX_STRATEGIES) * len(PROFILES)
    rows = documented()
    stale = [
        (c.scenario, c.strategy, c.profile, c.short, rows.get((c.scenario, c.strategy, c.profile)))
        for c in cells
        if (c.short, str(c.result.metrics.get("duplicate_registrations", 0)))
        != rows.get((c.scenario, c.strategy, c.profile))
    ]
    assert not stale, f"docs/results.md is stale (python -m sim.lab.matrix > docs/results.md): {stale}"


def test_async_eplb_gives_the_sampled_cells_the_same_verdict(cells) -> None:
    """The exhaustive run checks every cell; here the dram ones."""
    dram = [c for c in cells if c.profile == "dram"]
    async_cells = run_matrix(profiles=("dram",), faults=("",), eplb_async=True)
    assert [(c.scenario, c.strategy, c.short) for c in async_cells] == [(c.scenario, c.strategy, c.short) for c in dram]
    assert any(a.result.trace_hash != s.result.trace_hash for a, s in zip(async_cells, dram))  # it ran async
