"""The same `epsim run --backend real` command started once per slot under torchrun (environment rendezvous)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import epsim, real_nixl_or_skip

LEDGER = ("registrations", "duplicate_registrations", "agents_created", "max_live_agents_per_process", "transfers")


def torchrun(slots: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(slots), "-m", "sim.cli", "run", *args, "--backend", "real", "--json"],
                          capture_output=True, text=True, timeout=300)


def test_scale_up_under_torchrun_agrees_with_the_local_runner():
    real_nixl_or_skip()
    args = ("scale-up", "--set", "timeline.0.to=3", "--set", "max_ranks=3", "--strategy", "per-communicator-agent")
    done = torchrun(3, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # only slot 0, which ran the engine, prints a verdict
    result = json.loads(lines[0])
    assert result["verdict"] == "pass" and result["profile"] == "real-cpu"
    # the same ledger as the simulation predicts (and the local runner shows: tests/real/test_real_runs.py)
    sim = json.loads(epsim("run", *args, "--json").stdout.strip().splitlines()[-1])
    assert {k: result["metrics"][k] for k in LEDGER} == {k: sim["metrics"][k] for k in LEDGER}
    assert result["metrics"]["duplicate_registrations"] == 2


def test_too_few_torchrun_slots_is_one_clear_line():
    real_nixl_or_skip()
    done = torchrun(2, "elastic-cycle")
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("epsim: error:")]
    assert errors == ["epsim: error: the scenario starts 6 rank processes in all; torchrun started 2 slots "
                      "(--nproc-per-node x nodes); each slot serves one rank"]
    done = torchrun(3, "scale-up", "--set", "timeline.0.to=3", "--set", "max_ranks=3", "--ranks-per-host", "2")
    assert done.returncode != 0
    assert [line for line in done.stderr.splitlines() if line.startswith("epsim: error:")] == [
        "epsim: error: the scenario runs up to 3 ranks at once; 1 host(s) at --ranks-per-host 2 take 2"]
