"""A real run whose rank processes are placed on the parent's clock only to within a bound, as torchrun slots on
another host are: the result says how far, and whether the verdict holds at the ends of the bound
(real_backends/ordering.py).  Multi-host runs are not possible here; the ranks run on this host and the launcher
reports the bound that a slot elsewhere would have measured."""

from __future__ import annotations

import pytest

from real_backends.launch import LocalLauncher
from real_backends.run import run_real
from sim.cli_run import summary
from sim.scenario import load, with_overrides
from tests.conftest import real_nixl_or_skip


class FarLauncher(LocalLauncher):
    """Local ranks that report the clock placement of a slot on another host: offset 0 (they share this clock, so
    the events stay where they are), bound ``bound_s``."""

    def __init__(self, bound_s: float) -> None:
        super().__init__()
        self.bound_s = bound_s

    def start(self, cfg):
        conn, proc = super().start(cfg)
        proc.info = {"clock_offset": 0.0, "clock_bound": self.bound_s, "host": "elsewhere"}
        return conn, proc


def up_2_to_3():
    up = load("scale-up")
    return with_overrides(up, max_ranks=3, timeline=[up.timeline[0].model_dump(mode="json") | {"to": 3}])


@pytest.fixture(autouse=True)
def _real_nixl():
    real_nixl_or_skip()


def test_a_bound_as_wide_as_the_run_puts_the_verdict_in_question():
    """Placed 30 s later, a reader's READs come after the whole run's events of the other ranks; the placements
    within such a bound change the verdict, and the result says so, naming each one."""
    result = run_real(up_2_to_3(), launcher=FarLauncher(30.0))
    assert result.verdict == "pass", result.detail  # as stamped: the ranks share this host's clock
    assert result.metrics["clock_bound_s"] == 30.0
    tried, placements = result.metrics["clock_placements"]
    assert 0 < tried <= placements
    changed = result.metrics["clock_sensitive"]
    # e.g. a reader's clock 30 s back puts its READs before its source registered anything
    assert any(line.startswith("pid ") and line.endswith(": safety (unregistered_access)") for line in changed), changed
    assert "the verdict DEPENDS on that placement" in summary(result)


def test_a_bound_far_below_the_run_s_spacing_leaves_the_verdict_standing():
    result = run_real(up_2_to_3(), launcher=FarLauncher(1e-7))
    assert result.verdict == "pass", result.detail
    assert result.metrics["clock_sensitive"] == []
    assert "the verdict holds" in summary(result) or "does not depend on the placement" in summary(result)
