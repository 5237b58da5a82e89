"""The pytest plugin: the fake_nixl fixture, its profile marker, and a light import."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_fake_nixl_fixture_installs_the_shims(fake_nixl) -> None:
    import nixl._api
    import nixl_cu13._api

    from fakes.install import is_fake

    assert is_fake(nixl._api) and is_fake(nixl_cu13._api)
    agent = nixl._api.nixl_agent("client")
    assert agent.agent.fabric is fake_nixl
    assert fake_nixl.profile.name == "dram"


@pytest.mark.nixl_profile("rocm-strict")
def test_fake_nixl_profile_marker(fake_nixl) -> None:
    import ctypes

    from nixl._api import nixl_agent
    from nixl._bindings import nixlBackendError

    buf = (ctypes.c_uint8 * 64)()
    a, b = nixl_agent("a"), nixl_agent("b")
    a.register_memory([(ctypes.addressof(buf), 64, 0, "")], "DRAM")
    with pytest.raises(nixlBackendError):
        b.register_memory([(ctypes.addressof(buf), 64, 0, "")], "DRAM")
    assert fake_nixl.profile.name == "rocm-strict"


INNER = """
import importlib

from fakes.install import is_fake


def test_uses_the_fake(fake_nixl):
    assert is_fake(importlib.import_module("nixl._api"))


def test_after_it():
    try:
        api = importlib.import_module("nixl._api")
    except ImportError:  # no real NIXL here: what an import gives without the shims
        return
    assert not is_fake(api)
"""


def test_shims_are_gone_after_the_fixture(tmp_path) -> None:
    """A test after one that used ``fake_nixl`` imports the real ``nixl._api`` (or nothing), never the fake: run as
    a session of its own, so the order of this file's tests does not decide it (review: it passed vacuously alone)."""
    (tmp_path / "test_inner.py").write_text(INNER)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_inner.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout + done.stderr


def test_plugin_and_cli_front_door_import_nothing_heavy() -> None:
    code = (
        "import sys, sim, sim.pytest_plugin, sim.cli\n"
        "heavy = sorted(m for m in ('torch', 'nixl', 'nixl_cu12', 'simpy', 'greenlet') if m in sys.modules)\n"
        "print(','.join(heavy))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_judging_a_real_run_imports_neither_torch_nor_the_simulated_workers() -> None:
    """The real backend's judge replays a run's events through the oracles: it needs the history's record shapes
    (sim/records.py), not the cluster that also builds workers and their tensors."""
    code = (
        "import sys, real_backends.judge\n"
        "print(','.join(sorted(m for m in ('torch', 'sim.cluster', 'sim.worker') if m in sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
