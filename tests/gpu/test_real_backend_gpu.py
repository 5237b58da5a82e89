"""On a CUDA host: the real backend with expert weights in VRAM, one rank process per GPU (in turn)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import epsim, real_nixl_or_skip, started_as

UP_2_TO_3 = ("scale-up", "--set", "timeline.0.to=3", "--set", "max_ranks=3")
IN_STEP = ("--set", "serving.async_scheduling=false")  # the host waits for each step: no forward work queued
LEDGER = ("registrations", "duplicate_registrations", "agents_created", "transfers", "bytes_moved")


def _run(*args: str) -> dict:
    done = epsim("run", *args, "--json", timeout=600)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["shared-agent", "per-communicator-agent", "arena-registry"])
def test_scale_up_on_vram_agrees_with_the_cuda_profile(strategy, tmp_path) -> None:
    real_nixl_or_skip()
    real = _run(
        *UP_2_TO_3, *IN_STEP, "--strategy", strategy, "--backend", "real", "--device", "cuda", "--out", str(tmp_path)
    )
    sim = _run(*UP_2_TO_3, *IN_STEP, "--strategy", strategy, "--profile", "cuda")
    assert real["profile"] == "real-cuda"
    # GPU ranks come from the zygote as CPU ranks do (it makes no CUDA context; each rank makes its own).
    assert set(started_as(tmp_path)) == {"fork"}, started_as(tmp_path)
    assert {k: real["metrics"][k] for k in LEDGER} == {k: sim["metrics"][k] for k in LEDGER}
    assert (sim["verdict"], sim["invariant"]) == ("pass", None)
    if (real["verdict"], real["invariant"]) == ("safety", "expert_weights") and "of layer" in real["detail"]:
        # A row holds another layer's expert: the zero-copy communicator posted the next layer's READs while the
        # stream still copied the last one out of expert_buffer.  With the host in step, the simulation shows it
        # only with device.stream_lag (docs/validation.md), so this run is reported, not passed.
        pytest.xfail(f"real hardware lost the copy/READ race without injected lag: {real['detail']}")
    assert (real["verdict"], real["invariant"]) == ("pass", None), real["detail"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "strategy, verdict",
    [("shared-agent", ("safety", "expert_weights")), ("tests.strategies.stream_synced:create", ("pass", None))],
)
def test_a_lagging_stream_gives_the_simulated_verdict_on_vram(strategy, verdict) -> None:
    """The copy/READ race of sim/device.py, forced with a sleep kernel in front of each row copy."""
    real_nixl_or_skip()
    lag = ("--fault", "device.stream_lag:delay_s=0.01")
    real = _run(*UP_2_TO_3, *IN_STEP, "--strategy", strategy, "--backend", "real", "--device", "cuda", *lag)
    sim = _run(*UP_2_TO_3, *IN_STEP, "--strategy", strategy, "--profile", "cuda", *lag)
    assert (real["verdict"], real["invariant"]) == (sim["verdict"], sim["invariant"]) == verdict


@pytest.mark.gpu
@pytest.mark.parametrize("use_async", ["false", "true"])
@pytest.mark.parametrize(
    "strategy, verdict",
    [("shared-agent", ("safety", "expert_weights")), ("tests.strategies.stream_synced:create", ("pass", None))],
)
def test_vllms_default_async_scheduling_gives_the_simulated_verdict_on_vram(strategy, verdict, use_async) -> None:
    """No fault: a step's forward work (a sleep kernel of one scenario step) is still queued when EPLB runs, as
    under vLLM's default async scheduling, and EPLB's copies wait behind it; sync and async EPLB alike."""
    real_nixl_or_skip()
    opts = ("--strategy", strategy, "--set", f"eplb.use_async={use_async}")
    real = _run(*UP_2_TO_3, *opts, "--backend", "real", "--device", "cuda")
    sim = _run(*UP_2_TO_3, *opts, "--profile", "cuda")
    assert (real["verdict"], real["invariant"]) == (sim["verdict"], sim["invariant"]) == verdict, real["detail"]
