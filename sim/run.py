"""One simulated run from a scenario: set up, run, judge.  What ``epsim run`` prints and what sweeps store."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import time
from pathlib import Path
from typing import Sequence

from . import quiet
from . import faults as fault_catalogue
from .cluster import ENGINE_PID, Cluster
from .errors import HarnessError, InternalError, ScenarioError, exception_line
from .outputs import write_run_files
from .result import Result, same_signature, signature

__all__ = ["Result", "run_scenario", "same_signature", "signature"]


def run_scenario(
    scenario,
    *,
    seed: int | None = None,
    strategy: str | None = None,
    profile: str | None = None,
    faults: Sequence[str | fault_catalogue.Armed] = (),
    out: str | Path | None = None,
    on_progress=None,
    calibration=None,
    tidy: bool = True,
) -> Result:
    """Run ``scenario`` (a :class:`sim.scenario.Scenario`) once; ``out`` gets the history and a Perfetto trace.
    ``tidy``: finalize the simulated world before returning (False: a process about to exit leaves it to the OS)."""
    seed = scenario.seed if seed is None else seed
    strategy = strategy or scenario.strategy
    profile = profile or scenario.profile
    from fakes.nixl.profiles import PROFILES

    if profile not in PROFILES:
        raise ScenarioError(f"profile {profile!r} not found; known: {', '.join(PROFILES)}")
    armed = fault_catalogue.arm(scenario.faults, faults)
    # What exists before the run (an earlier run's leftovers, a test process's heap) is not the run's: frozen, it is
    # neither traversed by the run's planned collections (whose cost grew with the caller's heap: the strategy
    # matrix took twice as long inside the test suite as alone) nor finalized in the middle of this run.
    # A caller that froze objects itself (a pre-fork server) keeps them frozen: unfreezing is all or nothing, so the
    # run leaves the collector as it found it and pays for the caller's heap.
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        return _run(scenario, seed, strategy, profile, armed, out, on_progress, calibration)
    finally:
        if tidy and freeze:
            _finalize_leftovers()
        if freeze:
            gc.unfreeze()


def _finalize_leftovers() -> None:
    """The finished run's simulated world, finalized now while it is all that is not frozen (a collection of the
    run's objects only), instead of at some later collection or at exit.  What its finalizers say (a leaked DeepEP
    buffer's warning, the fake NIXL refusing a dead agent's call) is in the run's history already; on stderr it
    would only be noise under the command's output."""
    with quiet.during_a_run(), contextlib.redirect_stderr(io.StringIO()):
        gc.collect()


def _run(scenario, seed, strategy, profile, armed, out, on_progress, calibration) -> Result:
    started = time.perf_counter()
    cluster = Cluster(
        scenario,
        seed=seed,
        strategy=strategy,
        profile=profile,
        faults=armed,
        on_progress=on_progress,
        calibration=calibration,
    )
    with quiet.during_a_run():
        cluster.run()
        wall = time.perf_counter() - started
        for thread, exc in cluster.kernel.crashes:
            if thread.pid == ENGINE_PID:
                cluster.kernel.close()
                raise InternalError(
                    f"epsim's engine failed at {cluster.kernel.now():g} s simulated: "
                    f"{exception_line(exc)}; a bug in epsim, not in the code under test"
                ) from exc
        cluster.kernel.history.refuse_malformed()
        unjudged = cluster.unjudged()
        if unjudged is not None:
            cluster.kernel.close()
            raise HarnessError(f"strategy {strategy!r}: {unjudged}")
        result = _result(cluster, scenario, seed, strategy, profile, armed, wall)
        result.spans = [[what, round(a, 6), round(b, 6)] for what, a, b in cluster.timeline.spans]
        # The recorded decisions ride on the result for replay; not a field, so --json does not print them.
        tape = vars(result)["tape"] = cluster.kernel.streams.tape.entries
        try:
            if out is not None:
                history = cluster.kernel.history
                write_run_files(
                    out,
                    {
                        "history.jsonl": history.write_jsonl,
                        "trace.perfetto.json": lambda p: history.write_perfetto(p, result.spans),
                        "tape.json": lambda p: p.write_text(
                            json.dumps({"seed": seed, "decisions": tape}, default=str) + "\n"
                        ),
                        "result.json": lambda p: p.write_text(json.dumps(result.to_dict()) + "\n"),
                    },
                    result,
                )
        finally:
            cluster.kernel.close()  # stuck greenlets unwind here; their finalizers' log lines stay quiet too
    return result


def _result(cluster, scenario, seed, strategy, profile, armed, wall) -> Result:
    verdict, invariant, detail = cluster.oracles.verdict()
    history = cluster.kernel.history
    first = cluster.oracles.first_problem()
    implicated = [] if first is None else [str(a) for t, _, a in cluster.faults.first_fired() if t <= first.t]
    crash = first.crash if first is not None else None
    metrics = dict(cluster.oracles.metrics)
    if cluster.vllm_moved:  # vLLM's rebalance_execute moved the experts, not epsim's model of it
        metrics["move_loop"] = "vllm"
    return Result(
        verdict,
        invariant,
        detail,
        seed,
        scenario.name,
        strategy,
        profile,
        history.trace_hash(),
        len(history),
        cluster.kernel.now(),
        round(wall, 3),
        [str(a) for a in armed],
        cluster.faults.fired(),
        metrics,
        implicated,
        signature(verdict, invariant, detail, strategy, implicated, crash),
        crash=crash,
    )
