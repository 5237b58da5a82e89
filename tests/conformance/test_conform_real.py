"""``epsim conform --backend real`` on this machine: the real NIXL on host memory is recognised as ``dram``."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import real_nixl_or_skip


def test_conform_real_names_dram() -> None:
    real_nixl_or_skip()
    done = subprocess.run([sys.executable, "-m", "sim.cli", "conform", "--backend", "real", "--json"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    failed = [c for c in report["cases"] if c["outcome"] != "pass"]
    assert not failed, failed
    assert report["matched_profile"] == "dram"
