"""On a CUDA host: the behaviour catalogue on VRAM through the real NIXL names the ``cuda`` profile."""

from __future__ import annotations

import pytest

from real_backends.probe import run_catalogue
from tests.conftest import real_nixl_or_skip


@pytest.mark.gpu
def test_real_nixl_on_vram_matches_cuda_profile() -> None:
    real_nixl_or_skip()
    report = run_catalogue("real", None, "VRAM")
    failed = [c for c in report["cases"] if c["outcome"] == "fail"]
    assert not failed, failed
    assert report["matched_profile"] == "cuda"
