"""vLLM's own EPLB communicator (the released 0.33.0 wheel's files, unmodified) under test in the simulation.

The sources come from the package index at test time (``pip download --no-deps vllm==0.33.0``, once, into epsim's
cache outside the repository); CI sets ``EPSIM_REQUIRE_VLLM=1``, so there a failed fetch fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from sim.run import run_scenario
from sim.scenario import load
from tests.conftest import epsim_here


def run(scenario: str, strategy: str = "vllm", **kw):
    return run_scenario(load(scenario), strategy=strategy, **kw)


@pytest.mark.parametrize(
    "scenario,verdict",
    [
        ("scale-up", ("pass", None)),
        ("scale-down", ("pass", None)),
        ("elastic-cycle", ("pass", None)),
        ("abort", ("safety", "stale_peer")),
    ],
)
def test_vllm_0_33_0_verdicts(released, scenario, verdict) -> None:
    r = run(scenario)
    assert (r.verdict, r.invariant) == verdict, r.detail
    assert r.metrics["transfers"] > 0  # vLLM's READs went through the fake NIXL
    # vLLM 0.33.0 makes an agent per communicator: one per rank at start, one more per surviving rank per PREPARE.
    assert r.metrics["agents_created"] >= 6


def test_an_aborted_prepare_keeps_the_departing_rank_loaded(released) -> None:
    """0.33.0 loads every peer in the constructor: the prepared (then aborted) communicator already holds the
    agent of the rank that was to join and left.  A later revision's deferred setup (the built-in shared-agent's)
    passes."""
    r = run("abort")
    assert "of departed pid 2 loaded after the reconfiguration" in r.detail
    assert run("abort", strategy="per-communicator-agent").detail == r.detail  # the built-in model agrees
    assert run("abort", strategy="shared-agent").verdict == "pass"


def test_rocm_refuses_the_second_agents_registration(released) -> None:
    r = run("scale-up", profile="rocm-strict")
    assert (r.verdict, r.invariant) == ("crash", "exception")
    assert "Failed to initialize NixlEplbCommunicator" in r.detail and "nixlBackendError" in r.detail


def test_a_lagging_stream_corrupts_vllm_0_33_0s_weights_on_cuda(released) -> None:
    """vLLM's NIXL READs do not wait for the stream's copies out of expert_buffer (sim/device.py): with the host in
    step with the GPU, an injected lag corrupts them, and so does the forward work that vLLM's default async
    scheduling leaves queued, without any fault; with neither, the weights are right."""
    from sim.scenario import with_overrides

    in_step = with_overrides(load("scale-up"), **{"serving.async_scheduling": False})
    r = run_scenario(in_step, strategy="vllm", profile="cuda", faults=["device.stream_lag:delay_s=0.01"])
    assert (r.verdict, r.invariant) == ("safety", "expert_weights"), r.detail
    assert run_scenario(in_step, strategy="vllm", profile="cuda").verdict == "pass"
    r = run("scale-up", profile="cuda")
    assert (r.verdict, r.invariant, r.faults_fired) == ("safety", "expert_weights", {}), r.detail


def test_vllms_rocm_branch_waits_for_the_stream_through_torch_accelerator(released) -> None:
    """On ROCm vLLM 0.33.0 calls torch.accelerator.current_stream().synchronize() before its READs; the simulated
    stream answers that spelling too, so the same lag that corrupts CUDA's weights is harmless there (steady: no
    reconfiguration, whose second registration rocm-strict refuses).  ROCm skips a rebalance that cuts the rank
    imbalance by under 5%, which every rebalance of the default steady load is: a sharper load makes some move."""
    from sim.scenario import with_overrides

    sc = with_overrides(load("steady"), **{"model.layers": 2, "serving.skew": 4.0, "serving.top_k": 1})
    lag = ["device.stream_lag:delay_s=0.01"]
    assert run_scenario(sc, strategy="vllm", profile="cuda", faults=lag).invariant == "expert_weights"
    r = run_scenario(sc, strategy="vllm", profile="rocm-strict", faults=lag)
    assert r.verdict == "pass" and r.faults_fired and r.metrics["transfers"] > 0, r.detail


def test_rocm_skips_a_rebalance_that_gains_under_five_percent() -> None:
    """vLLM 0.33.0's EplbState.rearrange on ROCm: a synchronous periodic rebalance whose placement cuts the rank
    load imbalance (summed over layers) by under 5% moves nothing; the same runs move experts on CUDA."""
    from sim.cluster import Cluster

    def rebalances(profile: str):
        c = Cluster(load("steady"), seed=0, strategy="per-communicator-agent", profile=profile)
        c.run()
        out = [f.get("skipped", False) for _, kind, f in c.kernel.history.records if kind == "engine.rebalance"]
        skipped = sum(kind == "eplb.skipped" for _, kind, _ in c.kernel.history.records)
        c.kernel.close()
        return out, skipped

    rocm, rocm_skipped = rebalances("rocm-strict")
    cuda, cuda_skipped = rebalances("cuda")
    assert rocm and all(rocm) and rocm_skipped == 2 * len(rocm)  # every rank, every rebalance
    assert not any(cuda) and cuda_skipped == 0


def test_the_seeds_change_on_vllms_class(released) -> None:
    """vllm+shared-agent: one agent per process for its whole life; the departed peers stay loaded."""
    up, down = run("scale-up", strategy="vllm+shared-agent"), run("scale-down", strategy="vllm+shared-agent")
    assert up.verdict == "pass" and up.metrics["agents_created"] == 4
    assert (down.verdict, down.invariant) == ("safety", "stale_peer")
    assert down.metrics["duplicate_registrations"] == 0


def test_old_indices_reach_the_code_under_test_as_vllm_passes_them(released, monkeypatch) -> None:
    seen = []
    from sim.vllm import strategy

    real = strategy.VllmProcess.create

    def spy(self, *args, **kwargs):
        comm = real(self, *args, **kwargs)
        inner = comm.set_transfer_context

        def set_transfer_context(old_indices, layer_idx):
            seen.append(old_indices)
            return inner(old_indices, layer_idx)

        comm.set_transfer_context = set_transfer_context
        return comm

    monkeypatch.setattr(strategy.VllmProcess, "create", spy)
    assert run("steady").verdict == "pass"
    # vLLM's rearrange_expert_weights_inplace passes rows of its map's .cpu().numpy(): int64 ndarrays.
    assert seen and all(isinstance(a, np.ndarray) and a.dtype == np.int64 and a.ndim == 1 for a in seen)


def test_every_process_has_its_own_vllm_modules(released) -> None:
    from sim.vllm import strategy

    first, second = strategy.VllmProcess(None, "vllm"), strategy.VllmProcess(None, "vllm")
    a, b = first.vllm["vllm.distributed.nixl_utils"], second.vllm["vllm.distributed.nixl_utils"]
    assert a is not b and a.__file__ == b.__file__ == str(released.root / "vllm/distributed/nixl_utils.py")
    assert not [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]
    # vLLM's files as released; only the modules it imports that need a GPU deployment are stood in for.
    comm = first.vllm["vllm.distributed.eplb.eplb_communicator"]
    assert comm.__file__.endswith("vllm/distributed/eplb/eplb_communicator.py")
    assert getattr(first.vllm["vllm.platforms"], "__epsim_standin__", False)
    assert not getattr(comm, "__epsim_standin__", False)


def test_vllm_0_33_0_same_trace_hash_under_any_hash_seed(released) -> None:
    """vLLM waits on a set of transfer handles: their iteration order must not depend on the interpreter."""
    hashes = set()
    for hashseed in ("0", "1", "12345"):
        done = subprocess.run(
            [sys.executable, "-m", "sim.cli", "run", "abort", "--strategy", "vllm", "--json"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONHASHSEED": hashseed},
        )
        hashes.add(json.loads(done.stdout)["trace_hash"])
    assert len(hashes) == 1, hashes


def _branch(tmp_path, released, edit) -> str:
    tree = tmp_path / "vllm-branch"
    shutil.copytree(released.root / "vllm", tree / "vllm")
    path = tree / "vllm/distributed/eplb/eplb_communicator.py"
    path.write_text(edit(path.read_text()))
    return str(tree)


def _first_row(text: str) -> str:
    """A branch whose add_recv reads every expert from the source's first row."""
    old = "send_base + src_row * send_stride,"
    assert old in text
    return text.replace(old, "send_base,")


def test_a_branch_of_vllm_from_a_source_tree_gets_its_own_verdict(tmp_path, released) -> None:
    tree = _branch(tmp_path, released, _first_row)
    branch = run("scale-down", strategy=f"vllm:{tree}")
    assert (branch.verdict, branch.invariant) == ("safety", "expert_weights")
    assert run("scale-down").verdict == "pass"
    from sim.vllm import source

    assert source.locate(tree).digest() != released.digest()
    assert source.locate(tree + "/vllm").root == source.locate(tree).root  # the checkout or its vllm/ folder


def test_a_branch_of_vllm_as_a_wheel(tmp_path, released, monkeypatch) -> None:
    monkeypatch.setenv("EPSIM_CACHE", str(tmp_path / "cache"))
    _branch(tmp_path, released, _first_row)  # writes tmp_path/vllm-branch
    wheel = tmp_path / "vllm-0.33.1.dev0-cp38-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path in sorted((tmp_path / "vllm-branch").rglob("*.py")):
            zf.write(path, path.relative_to(tmp_path / "vllm-branch").as_posix())
    r = run("scale-down", strategy=f"vllm:{wheel}")
    assert (r.verdict, r.invariant) == ("safety", "expert_weights")


@pytest.mark.parametrize(
    "arg,message",
    [
        ("vllm:/nonexistent/vllm", "no vllm/distributed/eplb/eplb_communicator.py under /nonexistent/vllm"),
    ],
)
def test_a_bad_vllm_source_is_one_line_exit_2(arg, message) -> None:
    done = epsim_here("run", "steady", "--strategy", arg)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_branch_that_does_not_import_is_one_line(tmp_path, released) -> None:
    tree = _branch(
        tmp_path,
        released,
        lambda text: text.replace("import numpy as np\n", "import numpy as np\nimport not_a_module\n"),
    )
    done = epsim_here("run", "steady", "--strategy", f"vllm:{tree}")
    assert done.returncode == 2 and "does not load here: ModuleNotFoundError" in done.stderr


@pytest.mark.parametrize(
    "scenario, overrides",
    [("scale-up", {}), ("scale-down", {}), ("elastic-cycle", {}), ("scale-up", {"eplb.use_async": True})],
)
def test_vllms_own_move_loop_moves_the_experts_and_epsims_model_of_it_calls_alike(
    released, monkeypatch, scenario, overrides
) -> None:
    """vLLM's rebalance_execute (rearrange_expert_weights_inplace; transfer_layer and move_from_buffer under async
    EPLB) runs for vLLM's communicator; epsim's model of the loop, which the built-in strategies run, makes the same
    communicator calls in the same order and times: the two histories are one."""
    from sim.scenario import with_overrides
    from sim.vllm import move_loop

    sc = with_overrides(load(scenario), **overrides)
    vllms = run_scenario(sc, strategy="vllm")
    assert vllms.verdict == "pass" and vllms.metrics["move_loop"] == "vllm", vllms.detail
    monkeypatch.setattr(move_loop, "of", lambda factory: None)
    model = run_scenario(sc, strategy="vllm")
    assert "move_loop" not in model.metrics
    assert (model.verdict, model.trace_hash, model.metrics["transfers"]) == (
        vllms.verdict,
        vllms.trace_hash,
        vllms.metrics["transfers"],
    )


def test_vllms_row_copies_go_onto_the_simulated_stream(released) -> None:
    """vLLM's non_blocking copies queue behind a lagged stream as epsim's did (sync and async EPLB), and a branch
    that synchronizes before its READs, as vLLM's ROCm branch does, survives the lag."""
    from sim.scenario import with_overrides

    in_step = {"serving.async_scheduling": False}
    lag = ["device.stream_lag:delay_s=0.01"]
    for use_async in (False, True):
        sc = with_overrides(load("scale-up"), **in_step, **{"eplb.use_async": use_async})
        r = run_scenario(sc, strategy="vllm", profile="cuda", faults=lag)
        assert (r.verdict, r.invariant, r.metrics["move_loop"]) == ("safety", "expert_weights", "vllm"), use_async
        assert r.faults_fired[lag[0]] > 0


def test_a_branch_whose_move_loop_does_not_load_runs_under_epsims_model(tmp_path, released) -> None:
    tree = tmp_path / "vllm-branch"
    shutil.copytree(released.root / "vllm", tree / "vllm")
    path = tree / "vllm/distributed/eplb/rebalance_execute.py"
    path.write_text("import not_a_module\n" + path.read_text())
    r = run("scale-down", strategy=f"vllm:{tree}")
    assert r.verdict == "pass" and "move_loop" not in r.metrics and r.metrics["transfers"] > 0


def test_peers_late_for_prepares_collective_are_liveness_however_wrapped(released) -> None:
    """The joining ranks' constructors wait in all_gather_object for the old ranks' PREPAREs, 3 s behind, longer
    than the group's 1 s timeout.  vLLM wraps the timeout in RuntimeError("NIXL EPLB init failed: agents"); what
    did not converge is the group, as for the built-in model that lets the timeout escape."""
    from sim.scenario import with_overrides

    sc = with_overrides(load("scale-up"), collective_timeout_s=1, **{"timeline.0.prepare_s": 3})
    ours, built_in = run_scenario(sc, strategy="vllm"), run_scenario(sc, strategy="per-communicator-agent")
    assert (
        (ours.verdict, ours.invariant) == (built_in.verdict, built_in.invariant) == ("liveness", "collective_timeout")
    )
    assert ours.detail is not None and ours.crash is not None
    assert "NIXL EPLB init failed: agents" in ours.detail and ours.crash["chain"][-1]["type"] == "CollectiveTimeout"


def test_a_sweep_bundle_of_vllms_code_replays(tmp_path, released) -> None:
    """A failure found in vLLM's code by a sweep (worker processes, each loading vLLM afresh) replays from its
    bundle with the same signature and trace hash."""
    from sim.lab import bundle
    from tests.conftest import epsim

    db, bundles = tmp_path / "r.db", tmp_path / "bundles"
    done = epsim("sweep", "abort", "--seeds", "0:2", "--strategy", "vllm", "--db", str(db), "--bundles", str(bundles))
    assert done.returncode in (0, 1), done.stderr[-2000:]
    found = sorted(p for p in bundles.iterdir() if p.is_dir())
    assert found, done.stdout
    replayed = bundle.replay(found[0])
    assert replayed.reproduced, (replayed.result.signature, replayed.result.trace_hash)
    assert replayed.result.strategy == "vllm" and replayed.result.invariant == "stale_peer"
