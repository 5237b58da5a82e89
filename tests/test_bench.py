"""``epsim bench``: the figures' shape (a quick run of the cheap ones), and the strategies of the time-to-detect
figure doing what they claim: the careful one survives what its fixes are for, each broken copy fails its way."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import kernel, simulation
from benchmarks.strategies import BROKEN, CAREFUL
from sim.run import run_scenario
from sim.scenario import load


def test_kernel_workload_is_the_same_on_both_sides() -> None:
    waits_simpy, _ = kernel.bare_simpy(16, 30, 10)
    waits_kernel, _ = kernel.greenlet_kernel(16, 30, 10)
    assert waits_simpy == waits_kernel == 16 * 30 + 16 * 3


def test_scaling_shape_grows_with_ranks() -> None:
    small, large = simulation.shape(8), simulation.shape(16)
    assert (small.ranks, small.model.experts, large.model.experts) == (8, 32, 64)
    assert small.timeline[0].to == 9 and large.timeline[0].to == 18


def test_bench_json_has_a_key_per_figure_with_target_and_verdict() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sim.cli",
            "bench",
            "--quick",
            "--only",
            "kernel_overhead",
            "--only",
            "scaling",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out) == {"quick", "kernel_overhead", "scaling"}
    assert out["kernel_overhead"]["target"] == ">= 0.5" and out["kernel_overhead"]["met"] in (True, False)
    assert 0 < out["kernel_overhead"]["64"]["ratio"] < 2 and out["kernel_overhead"]["1024"]["waits"] > 0
    assert [p["ranks"] for p in out["scaling"]["points"]] == [8, 16, 32, 64]
    assert all(p["verdict"] == "pass" for p in out["scaling"]["points"])
    bad = subprocess.run(
        [sys.executable, "-m", "sim.cli", "bench", "--only", "speed"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "figures are kernel_overhead" in bad.stderr


def test_bench_on_cuda_without_a_gpu_is_one_line_before_any_figure() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the refusal is for hosts without one")
    done = subprocess.run(
        [sys.executable, "-m", "sim.cli", "bench", "--quick", "--device", "cuda", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == ["epsim: error: --device cuda needs a CUDA GPU; none is visible here"]
    # A selection without the transfers figure has no use for the GPU: --device does not stop it.
    cheap = subprocess.run(
        [sys.executable, "-m", "sim.cli", "bench", "--quick", "--only", "time_to_detect", "--device", "cuda", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cheap.returncode == 0, cheap.stderr
    assert set(json.loads(cheap.stdout)) == {"quick", "time_to_detect"}


def test_sweep_throughput_measures_every_arm_twice_interleaved(monkeypatch) -> None:
    from benchmarks import sweeps

    order: list[tuple[str, int]] = []
    real_plain, real_through = sweeps._plain, sweeps._through

    def plain(specs) -> float:
        order.append(("plain", specs[0].seed))
        return real_plain(specs)

    def through(specs, engine) -> float:
        order.append((f"local{engine.workers}", specs[0].seed))
        return real_through(specs, engine)

    monkeypatch.setattr(sweeps, "_plain", plain)
    monkeypatch.setattr(sweeps, "_through", through)
    out = sweeps.throughput(runs=3, ray=False)
    assert [arm for arm, _ in order] == ["plain", "local1", "local2", "local2", "local1", "plain"]
    assert len({seed for _, seed in order}) == 6  # fresh seeds for every pass
    assert out["runs"] == 3 and out["passes"] == 2 and "ray_runs_per_s" not in out
    assert min(out["plain_runs_per_s"], out["local1_runs_per_s"], out["local2_runs_per_s"]) > 0


@pytest.mark.parametrize("fault", [None, "storage.move", "gc.thread"])
def test_careful_strategy_survives_what_its_fixes_are_for(fault) -> None:
    r = run_scenario(load("elastic-cycle"), strategy=CAREFUL, faults=[fault] if fault else [])
    assert r.verdict == "pass", r.detail


def test_careful_strategy_still_leaves_departed_peers_loaded_while_its_finalizer_is_delayed() -> None:
    r = run_scenario(load("scale-down"), strategy=CAREFUL, faults=["gc.late:delay_s=2"])
    assert (r.verdict, r.invariant) == ("safety", "stale_peer")


@pytest.mark.parametrize(
    "name, fault, expected",
    [
        ("finalizer deregisters shared memory", None, ("crash", "exception")),
        ("reused agent never re-registers moved storage", "storage.move", ("crash", "exception")),
        ("peer cache never cleaned", None, ("safety", "stale_peer")),
    ],
)
def test_each_broken_copy_fails_its_way(name, fault, expected) -> None:
    r = run_scenario(load("elastic-cycle"), strategy=BROKEN[name], faults=[fault] if fault else [])
    assert (r.verdict, r.invariant) == expected, r.detail


def test_a_nixl_peer_that_dies_is_one_error_not_a_reader_waiting_for_ever() -> None:
    """Found while timing calibration: the owner process died at start-up and the reader waited on the pipe for
    ever (this process still held the owner's end of it)."""
    from real_backends import transfers
    from real_backends.nixl_real import import_real_nixl
    from sim.errors import BackendUnavailable
    from tests.conftest import real_nixl_or_skip

    real_nixl_or_skip()
    api = import_real_nixl()[0]
    with pytest.raises(BackendUnavailable, match=r"NIXL peer process exited with status 1 before registering"):
        transfers._measure(api, "no_such_nixl_package", (1,), 1, "cpu")


def test_an_owner_whose_reader_gave_up_ends_quietly() -> None:
    """The reader stopped waiting (``from_owner``'s timeout) and closed its end before the owner registered: the owner
    returns instead of dying on a BrokenPipeError (which its process printed as a traceback)."""
    import multiprocessing as mp

    from real_backends import transfers
    from tests.conftest import real_nixl_or_skip

    package = real_nixl_or_skip()[2]
    reader_end, owner_end = mp.Pipe()
    reader_end.close()
    try:
        # returned; used to raise BrokenPipeError (ignored: mypy will not use the value of a call annotated -> None)
        assert transfers._owner(owner_end, package, (1,), "cpu") is None  # type: ignore[func-returns-value]
    finally:
        owner_end.close()


def test_a_reader_that_cannot_make_its_agent_leaves_no_owner_behind() -> None:
    import multiprocessing as mp
    from types import SimpleNamespace

    from real_backends import transfers
    from tests.conftest import real_nixl_or_skip

    package = real_nixl_or_skip()[2]

    def no_agent(*_a, **_k):
        raise RuntimeError("no UCX backend here")

    api = SimpleNamespace(nixl_agent=no_agent, nixl_agent_config=lambda **_k: None)
    before = set(mp.active_children())
    with pytest.raises(RuntimeError, match="no UCX backend here"):
        transfers._measure(api, package, (1,), 1, "cpu")
    assert set(mp.active_children()) == before  # the owner was told (its pipe closed) and joined
