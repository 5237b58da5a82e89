"""No run leaves a process behind: not when a rank is killed, not when the parent is interrupted or killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import epsim, real_nixl_or_skip, sigint_at_default


@pytest.fixture(autouse=True)
def _real_nixl():
    real_nixl_or_skip()


def living(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has: it only waits to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def wait_gone(pids: set[int], within_s: float = 15.0) -> set[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        left = {p for p in pids if living(p)}
        if not left:
            return left
        time.sleep(0.1)
    return {p for p in pids if living(p)}


def test_a_killed_rank_and_its_peers_are_all_gone_after_the_run(tmp_path):
    done = epsim("run", "rank-failure", "--backend", "real", "--timeout", "20", "--out", str(tmp_path), "--json")
    assert done.returncode == 1, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["verdict"] == "liveness"
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    ranks = {e["os_pid"] for e in history if e["kind"] == "process.start"}
    assert len(ranks) == 4
    # forked from the run's zygote (real_backends/zygote.py), which the kill and the run's end go through
    assert {e["started_as"] for e in history if e["kind"] == "process.start"} == {"fork"}
    assert any(e["kind"] == "process.kill" and e["pid"] == 3 for e in history)
    assert wait_gone(ranks, 5.0) == set()


def _start_long_run(tmp_path: Path | None = None) -> tuple[subprocess.Popen, set[int]]:
    """A real elastic-cycle run made long enough to interrupt, once all four rank processes are up.  Serving steps
    take no wall time on the real backend, rebalances do: with one every 200 steps the run lasts over a minute from
    its first scale-up on (with one every 100,000 it lasted 12 s in all, leaving little margin after four ranks are
    first seen)."""
    # Output to files when given: waiting for the parent must not depend on who else holds its pipes.
    out = (tmp_path / "stdout").open("w") if tmp_path else subprocess.PIPE
    err = (tmp_path / "stderr").open("w") if tmp_path else subprocess.PIPE
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sim.cli",
            "run",
            "elastic-cycle",
            "--backend",
            "real",
            "--set",
            "steps=400000",
            "--set",
            "eplb.step_interval=200",
        ],
        stdout=out,
        stderr=err,
        text=True,
        preexec_fn=sigint_at_default,
    )
    deadline = time.monotonic() + 120
    seen: set[int] = set()
    while time.monotonic() < deadline and proc.poll() is None:
        seen |= descendants(proc.pid)
        # scale-up to EP4 happened: 4 ranks alive (the processes with no child: the zygote they are forked from,
        # real_backends/zygote.py, has them)
        if len([p for p in seen if living(p) and not descendants(p)]) >= 4:
            break
        time.sleep(0.2)
    assert proc.poll() is None, (tmp_path / "stderr").read_text()[-2000:] if tmp_path else proc.communicate()[1]
    return proc, seen


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_an_interrupted_parent_stops_every_rank(how, tmp_path):
    proc, ranks = _start_long_run(tmp_path)
    proc.send_signal(getattr(signal, how))
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:  # say where it is stuck (epsim dumps its threads' stacks on SIGUSR1)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        left = sorted(p for p in descendants(proc.pid) if living(p))
        for p in [proc.pid, *left]:
            os.kill(p, signal.SIGKILL)
        pytest.fail(
            f"epsim still running 90 s after {how}; living descendants {left}; its stderr ends with:\n"
            + (tmp_path / "stderr").read_text()[-6000:]
        )
    out, err = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert proc.returncode == 130, (out[-2000:], err[-2000:])  # stdout too: a run that ended by itself prints there
    assert err.strip().splitlines()[-1] == "epsim: interrupted"
    assert "Traceback" not in err
    assert wait_gone(ranks) == set()


def test_a_killed_parent_takes_every_rank_with_it():
    proc, ranks = _start_long_run()
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert wait_gone(ranks) == set(), "rank processes outlived a SIGKILLed parent"
