"""The fake DeepEP and a real one run the same case (``deep_ep_case.run_case``): results equal to the reference,
and the destroy rules (``destroy()`` without ``explicitly_destroy`` is an AssertionError; any call after destroy
fails with AttributeError).  The real parameter needs a DeepEP build and two GPUs (marker ``gpu``); no wheel on PyPI
fits torch 2.11, so docs/deep-ep-fake.md says how to point this test at your own build (``EPSIM_DEEP_EP``)."""

from __future__ import annotations

import importlib
import os
import socket

import pytest

from tests.conformance import deep_ep_case

N = 2


def _fake() -> list[dict]:
    from fakes import deep_ep
    from sim.pytest_plugin import SimulatedRanks

    return SimulatedRanks(N).run(lambda g: deep_ep_case.run_case(deep_ep.Buffer, g, g.rank(), N))


def _real_rank(rank: int, port: int, module: str, results) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=N)
    deep_ep = importlib.import_module(module)
    results[rank] = deep_ep_case.run_case(deep_ep.Buffer, dist.group.WORLD, rank, N, device="cuda")
    dist.barrier()
    dist.destroy_process_group()


def _real() -> list[dict]:
    import torch
    import torch.multiprocessing as mp

    module = os.environ.get("EPSIM_DEEP_EP", "deep_ep")
    try:
        importlib.import_module(module)
    except ImportError as exc:
        pytest.skip(f"no DeepEP build importable as {module!r} ({exc}); see docs/deep-ep-fake.md")
    if torch.cuda.device_count() < N:
        pytest.skip(f"the real DeepEP case needs {N} GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_real_rank, args=(port, module, results), nprocs=N, join=True)
    return [results[r] for r in range(N)]


@pytest.mark.parametrize("impl", ["fake", pytest.param("real", marks=pytest.mark.gpu)])
def test_dispatch_combine_and_destroy_rules(impl: str) -> None:
    observed = _fake() if impl == "fake" else _real()
    for r in observed:
        assert r["max_error"] < 1e-2  # bf16-free float32 path on the fake; the real kernels may round
        assert sum(r["counts"]) <= r["received"] * deep_ep_case.TOPK
        assert r["after_destroy"] == "AttributeError"
        assert r["destroy_without_flag"] == "AssertionError"
