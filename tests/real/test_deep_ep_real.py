"""The real backend's DeepEP path, as far as it runs without a GPU: what it refuses, how the judge reads a rank's
all2all events, and how DeepEP's leak warning (a C ``printf`` on the rank's stdout) becomes an event. The runs
themselves (real buffers on VRAM) are validate's DeepEP cases, in the gated GPU job (docs/gpu-validation.md)."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from real_backends.judge import judge
from real_backends.rank import DEEP_EP_LEAK_WARNING


def test_a_deep_ep_scenario_needs_a_gpu_and_says_so():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sim.cli",
            "run",
            "scale-up",
            "--backend",
            "real",
            "--set",
            "all2all.backend=deepep_high_throughput",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "DeepEP's buffers live on GPUs; run it with --device cuda" in done.stderr


def test_the_judge_reads_a_wrong_forward_and_a_leak_warning():
    bad: list[tuple[float, int, int, str, dict[str, Any]]] = [
        (1.0, 0, 1, "all2all.checked", {"pid": 0, "problem": None}),
        (2.0, 1, 1, "all2all.checked", {"pid": 1, "problem": "token 3: combined [1.0] != reference [2.0]"}),
    ]
    _, oracles = judge(bad, 0.0, completed=True, stuck=[])
    assert [(p.verdict, p.invariant) for p in oracles.problems] == [("safety", "all2all")]
    assert "pid 1: token 3" in oracles.problems[0].detail
    leak = [(1.0, 0, 1, "deep_ep.leak", {"pid": 0, "team": "a buffer"})]
    _, oracles = judge(leak, 0.0, completed=True, stuck=[])
    assert [(p.verdict, p.invariant) for p in oracles.problems] == [("safety", "leak")]


def _print_the_warning(conn, stdout_path: str) -> None:
    import ctypes
    import os
    import time

    from real_backends import rank
    from real_backends.rank import watch_deep_ep_warnings

    # This process's stdout is a file (a pytest-xdist worker's is its channel to the controller: never write there).
    os.dup2(os.open(stdout_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)

    class Link(rank.Link):  # the real link's interface; its events go to the test as (kind, fields)
        def emit(self, kind: str, **fields: Any) -> None:
            conn.send((kind, fields))

    watch_deep_ep_warnings(Link(conn, 7), 7)
    libc = ctypes.CDLL(None)
    libc.printf(b"WARNING: destroy() was not called before DeepEP buffer destruction, which can leak resources.\n")
    libc.printf(b"something else\n")
    libc.fflush(None)
    print("and python's own line", flush=True)
    time.sleep(0.5)  # the reader thread hands the lines on before the process ends
    conn.send(("done", {}))


def test_deep_ep_s_printf_warning_becomes_an_event_and_still_reaches_stdout(tmp_path):
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    stdout = tmp_path / "stdout"
    proc = ctx.Process(target=_print_the_warning, args=(theirs, str(stdout)))
    proc.start()
    got, done = [], False
    while not done and mine.poll(30):
        msg = mine.recv()
        if msg[0] == "done":
            done = True
        else:
            got.append(msg)
    proc.join(10)
    assert done and got == [("deep_ep.leak", {"pid": 7, "team": "a buffer (DeepEP's warning names none)"})]
    out = stdout.read_text()
    assert "something else" in out and "and python's own line" in out and DEEP_EP_LEAK_WARNING in out


HOST_DOUBLE = Path(__file__).resolve().parent / "host_deep_ep"


@pytest.mark.parametrize(
    "scenario, sizes",
    [("scale-up", {"timeline.0.to": 4, "max_ranks": 4}), ("scale-down", {"ranks": 4, "timeline.0.to": 2})],
)
def test_the_real_rank_runs_vllm_s_managers_as_the_simulated_worker_does(scenario, sizes, monkeypatch):
    """The real rank's all2all lifecycle on CPU, over a ``deep_ep`` double whose collectives are gloo calls
    (tests/real/host_deep_ep): buffers made at load and at PREPARE, a forward through them at every serving command
    (right, or the run would fail `all2all`), the old buffer dropped at COMMIT, its manager destroyed on the cleanup
    thread while departing ranks destroy theirs at exit (collectives that pair, or the run would hang). The verdict
    is the simulation's: vLLM 0.33.0's MoE layer held the only strong reference to the old buffer, so dropping it
    leaks (DeepEP's warning, read off the rank's stdout)."""
    from real_backends import cluster
    from real_backends.run import run_real
    from sim import scenario as scenario_mod
    from sim.run import run_scenario

    monkeypatch.setattr(cluster, "check_real_all2all", lambda sc, device: None)  # the double runs on host memory
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HOST_DOUBLE), os.environ.get("PYTHONPATH")) if p))
    sc = scenario_mod.with_overrides(
        scenario_mod.load(scenario), **sizes, **{"all2all.backend": "deepep_high_throughput"}
    )
    strategy = "per-communicator-agent"
    real = run_real(sc, strategy=strategy, timeout_s=120)
    sim = run_scenario(sc, strategy=strategy, profile="dram")
    assert (real.verdict, real.invariant) == (sim.verdict, sim.invariant) == ("safety", "leak"), (
        real.detail,
        sim.detail,
    )
    assert real.detail is not None and "DeepEP buffer" in real.detail and "destroy()" in real.detail
