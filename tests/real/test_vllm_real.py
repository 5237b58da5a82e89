"""vLLM 0.33.0's own EPLB communicator on real NIXL 1.5.1 processes (CPU), judged as the simulation judges it.

vLLM's code passes the peer names ``add_remote_agent`` returns (bytes in 1.5.1) on to ``prep_xfer_dlist`` and
``remove_remote_agent``; the real ledger and the fake read them as NIXL does, so both worlds give the same verdict.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import epsim, epsim_here, real_nixl_or_skip

LEDGER = ("registrations", "duplicate_registrations", "agents_created", "transfers", "bytes_moved")


@pytest.fixture(autouse=True)
def _real_nixl():
    real_nixl_or_skip()


def run(*args: str, backend: str) -> dict:
    done = (epsim_here if backend == "sim" else epsim)("run", *args, "--backend", backend, "--json")
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "scenario,faults,verdict",
    [
        pytest.param("scale-down", [], ("pass", None), marks=pytest.mark.slow),
        ("abort", [], ("safety", "stale_peer")),  # the aborted PREPARE's communicator keeps the rank that was to join
        # the old communicator is never collected
        pytest.param("elastic-cycle", ["--fault", "gc.never"], ("safety", "stale_peer"), marks=pytest.mark.slow),
    ],
)
def test_vllm_0_33_0_on_real_nixl_gets_the_simulations_verdict(released, scenario, faults, verdict) -> None:
    sim = run(scenario, "--strategy", "vllm", *faults, backend="sim")
    real = run(scenario, "--strategy", "vllm", *faults, backend="real")
    assert (real["verdict"], real["invariant"]) == (sim["verdict"], sim["invariant"]) == verdict, real["detail"]
    assert real["profile"] == "real-cpu" and real["metrics"]["transfers"] > 0
    assert real["metrics"]["move_loop"] == sim["metrics"]["move_loop"] == "vllm"  # vLLM's rebalance_execute
    if verdict[0] == "pass":  # a whole run: the real ledger counts what the simulation counts
        assert {k: real["metrics"][k] for k in LEDGER} == {k: sim["metrics"][k] for k in LEDGER}
    else:  # the departed rank still loaded is named in both worlds
        assert "of departed pid 2 loaded after the reconfiguration to pids 0-1" in real["detail"]
        assert "of departed pid 2 loaded after the reconfiguration to pids 0-1" in sim["detail"]


@pytest.mark.parametrize("lifecycle,verdict", [("0.33.0", ("pass", None)), ("pr-53947", ("safety", "stale_peer"))])
def test_the_collection_after_the_swap_on_real_nixl(released, lifecycle, verdict) -> None:
    """An old communicator that a reference cycle keeps: vLLM 0.33.0 collects again after the swap and its agent
    is gone before the scale-down completes; the revision that collects only before the swap still has the
    departed rank loaded then.  Real processes, a real gc.collect(), as the simulation says."""
    args = ("scale-down", "--strategy", "vllm", "--fault", "gc.cycle", "--set", f"lifecycle={lifecycle}")
    sim, real = run(*args, backend="sim"), run(*args, backend="real")
    assert (real["verdict"], real["invariant"]) == (sim["verdict"], sim["invariant"]) == verdict, real["detail"]
