"""The simulated CUDA stream (sim/device.py): row copies issued late, READs that overtake them, and the fix.

The finding it reproduces was seen once on an H200 pair (docs/validation.md): a layer's weights held another
layer's expert after a rebalance, because vLLM's non_blocking copies out of ``expert_buffer`` had not run when the
next layer's READs landed in it.
"""

from __future__ import annotations

import pytest
import torch

from sim.device import DeviceStream, installed
from sim.kernel import Kernel
from sim.run import run_scenario
from sim.scenario import load

SYNCED = "tests.strategies.stream_synced:create"


def run(strategy: str, faults=(), scenario: str = "scale-up", seed: int = 0):
    return run_scenario(load(scenario), seed=seed, strategy=strategy, faults=list(faults))


@pytest.mark.parametrize("strategy", ["per-communicator-agent", "arena-registry", "shared-agent"])
def test_a_lagging_stream_corrupts_the_weights_of_every_zero_copy_strategy(strategy: str) -> None:
    assert run(strategy).verdict == "pass"
    r = run(strategy, ["device.stream_lag:delay_s=0.01"])
    assert (r.verdict, r.invariant) == ("safety", "expert_weights"), r.detail
    assert "of layer" in r.detail  # the row holds another layer's expert, as on the H200 pair
    assert r.implicated == ["device.stream_lag:delay_s=0.01"]


def test_synchronizing_before_the_reads_fixes_it() -> None:
    r = run(SYNCED, ["device.stream_lag:delay_s=0.01"])
    assert r.verdict == "pass", r.detail
    assert r.faults_fired["device.stream_lag:delay_s=0.01"] > 0


def test_a_lag_shorter_than_a_read_is_harmless() -> None:
    # A READ of the scenario's nominal 42 MiB expert takes about 1.1 ms here: copies 0.1 ms late still run first.
    assert run("shared-agent", ["device.stream_lag:delay_s=0.0001"]).verdict == "pass"


@pytest.mark.parametrize(
    "strategy, lag, verdict",
    [("shared-agent", 0.0001, "pass"), ("shared-agent", 0.01, "safety"), (SYNCED, 0.01, "pass")],
)
def test_async_eplb_races_the_same_way(strategy: str, lag: float, verdict: str) -> None:
    # vLLM's main thread copies a layer out of expert_buffer at a step boundary, on the compute stream, and the
    # async thread posts the next layer's READs right after: the slack is a READ, not a forward step.
    from sim.scenario import with_overrides

    sc = with_overrides(load("scale-up"), **{"eplb.use_async": True})
    r = run_scenario(sc, seed=0, strategy=strategy, faults=[f"device.stream_lag:delay_s={lag}"])
    assert r.verdict == verdict, r.detail
    if verdict == "safety":
        assert r.invariant == "expert_weights" and r.detail is not None and "of layer" in r.detail


def test_a_stream_that_keeps_up_changes_no_history() -> None:
    plain = run("shared-agent")
    never = run("shared-agent", ["device.stream_lag:rank=99"])  # armed, never fires
    synced = run(SYNCED)  # synchronizes an empty stream: nothing recorded
    assert never.trace_hash == plain.trace_hash
    assert synced.trace_hash == plain.trace_hash


def test_lagging_runs_are_deterministic() -> None:
    a = run("shared-agent", ["device.stream_lag:delay_s=0.005"], "elastic-cycle", seed=3)
    b = run("shared-agent", ["device.stream_lag:delay_s=0.005"], "elastic-cycle", seed=3)
    assert (a.trace_hash, a.verdict, a.detail) == (b.trace_hash, b.verdict, b.detail)


def _stream_world():
    kernel = Kernel(seed=0)
    stream = DeviceStream(kernel, pid=7)
    return kernel, stream


def test_each_copy_waits_the_lag_behind_the_one_before_it() -> None:
    kernel, stream = _stream_world()
    ran: list[tuple[str, float]] = []
    stream.submit(lambda: ran.append(("now", kernel.now())), "a")  # keeps up: runs at once
    stream.lag_s = 0.5
    stream.submit(lambda: ran.append(("first", kernel.now())), "b")
    stream.lag_s = 0.1  # issued at once, it waits for the first, then its own lag
    stream.submit(lambda: ran.append(("second", kernel.now())), "c")
    assert ran == [("now", 0.0)] and not stream.query()
    kernel.run()
    assert ran == [("now", 0.0), ("first", 0.5), ("second", pytest.approx(0.6))]
    assert stream.query()


def test_forward_work_left_on_the_stream_delays_the_copies_issued_behind_it() -> None:
    """serving.host_ahead_steps: the host returns from a forward step with work still queued; a copy issued then
    runs once that work is done, and a synchronize with no copy queued still waits for it."""
    kernel, stream = _stream_world()
    ran: list[tuple[str, float]] = []
    waited: list[float] = []

    def rank() -> None:
        stream.backlog(0.25)
        stream.submit(lambda: ran.append(("copy", kernel.now())), "copy")
        assert ran == [] and not stream.query()
        kernel.sleep(0.5, "serving")
        stream.backlog(0.25)  # the next step's work: busy until 0.75 s
        stream.synchronize("test")
        waited.append(kernel.now())
        stream.submit(lambda: ran.append(("after", kernel.now())), "after")  # the stream is idle: runs at once

    kernel.spawn("rank", rank, pid=7)
    kernel.run()
    assert ran == [("copy", 0.25), ("after", 0.75)] and waited == [0.75]


def test_no_work_is_left_queued_on_host_memory_profiles() -> None:
    from sim.scenario import with_overrides

    sc = with_overrides(load("scale-up"), **{"serving.host_ahead_steps": 0.2})
    assert run_scenario(sc, strategy="per-communicator-agent", profile="dram").verdict == "pass"
    cuda = run_scenario(sc, strategy="per-communicator-agent", profile="cuda")
    assert (cuda.verdict, cuda.invariant) == ("safety", "expert_weights") and not cuda.faults_fired


def test_synchronize_waits_for_the_stream_and_a_reader_flushes_it() -> None:
    kernel, stream = _stream_world()
    ran: list[tuple[str, float]] = []
    waited: list[float] = []

    def rank() -> None:
        stream.lag_s = 1.0
        for name in ("x", "y"):
            stream.submit(lambda name=name: ran.append((name, kernel.now())), name)
        stream.synchronize("test")
        waited.append(kernel.now())
        stream.submit(lambda: ran.append(("z", kernel.now())), "z")
        stream.flush("a stream-ordered reader")  # runs it now, and no one waits

    kernel.spawn("rank", rank, pid=7)
    kernel.run()
    assert [name for name, _ in ran] == ["x", "y", "z"]
    assert waited == [2.0] and ran[-1] == ("z", 2.0)  # x ran at 1 s, y at 2 s; the thread woke at 2 s
    syncs = [(kind, f) for _, kind, f in kernel.history.records if kind.startswith("device.")]
    assert syncs == [
        ("device.sync", {"pid": 7, "reason": "test", "copies": 2, "first": "x"}),
        ("device.flush", {"pid": 7, "reason": "a stream-ordered reader", "copies": 1, "first": "z"}),
    ]


def test_a_copy_issued_after_a_flush_runs_at_its_own_time_not_at_a_flushed_copy_s() -> None:
    # Each issued copy arms a timer, and a flush runs the copies before their timers fire; those timers must not
    # then run whatever is oldest in the queue, or a later copy runs at a flushed copy's time, early.
    kernel, stream = _stream_world()
    ran: list[tuple[str, float]] = []

    def rank() -> None:
        stream.lag_s = 1.0
        for name in ("a", "b"):  # due at 1 s and 2 s
            stream.submit(lambda name=name: ran.append((name, kernel.now())), name)
        kernel.sleep(0.5)
        stream.flush("a stream-ordered reader")  # a and b run now
        kernel.sleep(0.1)
        stream.submit(lambda: ran.append(("c", kernel.now())), "c")  # behind the stream's backlog: due at 3 s

    kernel.spawn("rank", rank, pid=7)
    kernel.run()
    assert ran == [("a", 0.5), ("b", 0.5), ("c", 3.0)]
    assert stream.query()


@pytest.mark.parametrize("seed", range(8))
def test_a_copy_issued_right_after_a_synchronize_is_not_run_by_the_last_copy_s_timer(seed: int) -> None:
    # The thread's wake-up and the last copy's timer fire at the same instant, in an order the seed draws.
    kernel = Kernel(seed=seed)
    stream = DeviceStream(kernel, pid=7)
    ran: list[tuple[str, float]] = []

    def rank() -> None:
        stream.lag_s = 1.0
        stream.submit(lambda: ran.append(("x", kernel.now())), "x")
        stream.synchronize("test")
        stream.submit(lambda: ran.append(("y", kernel.now())), "y")

    kernel.spawn("rank", rank, pid=7)
    kernel.run()
    assert ran == [("x", 1.0), ("y", 2.0)]


def test_torch_cuda_is_the_simulated_stream_only_inside_a_simulated_process() -> None:
    kernel, stream = _stream_world()
    before = torch.cuda.current_stream, torch.cuda.synchronize
    seen = []

    def body() -> None:
        seen.append(torch.cuda.current_stream())
        torch.cuda.synchronize()

    with installed({7: stream}, kernel):
        kernel.spawn("rank", body, pid=7)
        kernel.run()
        if not torch.cuda.is_available():  # outside a simulated process: torch's own (no CUDA here)
            with pytest.raises((AssertionError, RuntimeError)):
                torch.cuda.current_stream()
    assert seen == [stream]
    assert (torch.cuda.current_stream, torch.cuda.synchronize) == before


@pytest.mark.parametrize("strategy", ["per-communicator-agent", "arena-registry", "shared-agent"])
def test_the_builtin_strategies_take_vllms_rocm_branch_on_rocm(strategy: str) -> None:
    """vLLM 0.33.0 synchronizes the stream in set_transfer_context on ROCm only; the built-in models do the same
    where torch says the ranks run on ROCm (the rocm-strict profile), so a lagging stream is harmless there and
    corrupts the weights on cuda.  A sharper load than steady's: ROCm skips rebalances that gain under 5%."""
    from sim.scenario import with_overrides

    sc = with_overrides(load("steady"), **{"model.layers": 2, "serving.skew": 4.0, "serving.top_k": 1})
    lag = ["device.stream_lag:delay_s=0.01"]
    rocm = run_scenario(sc, strategy=strategy, profile="rocm-strict", faults=lag)
    assert rocm.verdict == "pass" and rocm.metrics["transfers"] > 0, rocm.detail
    assert run_scenario(sc, strategy=strategy, profile="cuda", faults=lag).invariant == "expert_weights"
    assert torch.version.hip is None  # the run's ROCm is gone with the run
