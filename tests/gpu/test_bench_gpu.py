"""NIXL READ of expert-sized VRAM transfers against a torch peer copy (the gpu half of the real-transfers figure)."""

from __future__ import annotations

import pytest

from tests.conftest import real_nixl_or_skip

pytestmark = pytest.mark.gpu


def test_vram_reads_move_the_bytes_and_are_measured() -> None:
    real_nixl_or_skip()
    from real_backends import transfers

    out = transfers.measure(sizes_mib=(1, 64), repeats=5, device="cuda")
    assert out["memory"] == "VRAM"
    for size in ("1MiB", "64MiB"):  # measure() checks the bytes arrived before timing
        assert out["sizes"][size]["nixl_GBps"] > 0 and out["sizes"][size]["torch_GBps"] > 0
