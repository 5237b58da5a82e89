"""The pytest plugin, run in a pytest of its own: seeds from the marker and from --epsim-seeds, fixtures, and the
replay command of a failing seed in the terminal report and in JUnit XML."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

USER_TEST = """
import pytest

@pytest.mark.epsim(seeds=3)
def test_scale_up_survives(epsim_run, epsim_seed):
    # seed 1 runs the strategy that rocm-strict refuses: that seed fails, the others pass
    profile = "rocm-strict" if epsim_seed == 1 else "dram"
    r = epsim_run("scale-up", strategy="per-communicator-agent", profile=profile)
    assert r.verdict == "pass", r.detail

def test_fixtures(fake_nixl, epsim_cluster):
    import nixl._api
    agent = nixl._api.nixl_agent("a", nixl._api.nixl_agent_config(backends=["UCX"]))
    assert agent.name == "a" and len(fake_nixl.conns) == 1
    cluster = epsim_cluster("steady")
    cluster.run()
    assert cluster.oracles.verdict()[0] == "pass"
"""


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_marker_seeds_fixtures_and_the_replay_command(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(USER_TEST)
    done = _pytest(tmp_path, "--junitxml", "junit.xml")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 3 passed" in done.stdout
    cmd = "epsim run scale-up --seed 1 --strategy per-communicator-agent --profile rocm-strict"
    assert f"replay the failing seed's run with: {cmd}" in done.stdout
    failures = [tc for tc in ET.parse(tmp_path / "junit.xml").iter("testcase") if tc.find("failure") is not None]
    assert [tc.get("name") for tc in failures] == ["test_scale_up_survives[seed=1]"]
    failure = failures[0].find("failure")
    assert failure is not None
    message, text = failure.get("message"), failure.text
    assert message is not None and text is not None
    assert f"[epsim replay: {cmd}]" in message and cmd in text
    # the command does replay it
    again = subprocess.run(
        [sys.executable, "-m", "sim.cli", *cmd.split()[1:], "--json"], capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 1 and '"verdict": "crash"' in again.stdout


def test_epsim_seeds_option_overrides_the_marker(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(USER_TEST)
    done = _pytest(tmp_path, "--epsim-seeds", "2:4", "-k", "survives", "--collect-only")
    assert "test_scale_up_survives[seed=2]" in done.stdout and "test_scale_up_survives[seed=3]" in done.stdout
    assert "seed=0" not in done.stdout and "seed=1" not in done.stdout
    bad = _pytest(tmp_path, "--epsim-seeds", "x:y", "--collect-only")
    assert bad.returncode != 0 and "--epsim-seeds 'x:y': give N or A:B" in bad.stderr, bad.stderr


NIXL_SUITE = """
import logging

import nixl._api
import nixl._bindings as bindings
import nixl._utils as utils
from nixl.logging import get_logger


def test_the_whole_package_is_the_fake():
    assert getattr(nixl._api, "__name__", "").startswith("fakes.")
    assert bindings.nixlAgentConfig.__module__.startswith("fakes.")
    addr = utils.malloc_passthru(16)
    utils.ba_buf(addr, 16)
    utils.free_passthru(addr)
    assert get_logger("_suite").name == "nixl.suite"
    from fakes.nixl._fabric import current_fabric

    assert current_fabric().profile.name == "rocm-strict"


def test_status_calls_return_success():
    agent = bindings.nixlAgent("A", bindings.nixlAgentConfig())
    ucx = agent.createBackend("UCX", {})
    addr = utils.malloc_passthru(64)
    descs = bindings.nixlRegDList(bindings.DRAM_SEG)
    descs.addDesc((addr, 64, 0, ""))
    assert agent.registerMem(descs, [ucx]) == bindings.NIXL_SUCCESS
    assert agent.deregisterMem(descs, [ucx]) == bindings.NIXL_SUCCESS
    utils.free_passthru(addr)
"""


def test_fake_nixl_runs_a_suite_written_for_nixl_against_the_fake(tmp_path: Path) -> None:
    """``--fake-nixl``: a test suite that imports NIXL at module level (NIXL's own does) gets the fake's whole
    package, in the profile asked for; a bad profile is a usage error."""
    (tmp_path / "test_suite.py").write_text(NIXL_SUITE)
    done = _pytest(tmp_path, "--fake-nixl", "--fake-nixl-profile", "rocm-strict")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    bad = _pytest(tmp_path, "--fake-nixl", "--fake-nixl-profile", "nvlink")
    assert bad.returncode != 0 and "--fake-nixl-profile 'nvlink': profiles are" in bad.stderr
