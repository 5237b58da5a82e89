"""One run of a scenario on the real backend: rank processes, real NIXL, gloo groups; the same verdict JSON as a
simulated run (``profile`` names the world: ``real-cpu`` or ``real-cuda``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

from sim import faults as fault_catalogue
from sim.outputs import write_run_files
from sim.result import Result, signature

from .cluster import RealCluster
from .launch import LocalLauncher
from .nixl_real import require_real
from .judge import judge
from .ordering import clock_sensitivity


def run_real(
    scenario,
    *,
    seed: int | None = None,
    strategy: str | None = None,
    faults: Sequence[str | fault_catalogue.Armed] = (),
    device: str = "cpu",
    timeout_s: float = 120.0,
    out: str | Path | None = None,
    on_progress=None,
    launcher=None,
    ranks_per_host: int | None = None,
) -> Result:
    seed = scenario.seed if seed is None else seed
    strategy = strategy or scenario.strategy
    armed = fault_catalogue.arm(scenario.faults, faults)
    if launcher is None:
        launcher = LocalLauncher(ranks_per_host)
    require_real(device)
    started = time.perf_counter()
    cluster = RealCluster(
        scenario,
        seed=seed,
        strategy=strategy,
        faults=armed,
        device=device,
        timeout_s=timeout_s,
        on_progress=on_progress,
        launcher=launcher,
    )
    cluster.run()
    wall = time.perf_counter() - started
    history, oracles = judge(cluster.events, cluster.t0, completed=cluster.completed, stuck=cluster.stuck)
    history.refuse_malformed()
    verdict, invariant, detail = oracles.verdict()
    first = oracles.first_problem()
    implicated = (
        [] if first is None else [str(a) for t, _, a in cluster.faults.first_fired() if t - cluster.t0 <= first.t]
    )
    profile = f"real-{device}"
    crash = first.crash if first is not None else None
    result = Result(
        verdict,
        invariant,
        detail,
        seed,
        scenario.name,
        strategy,
        profile,
        history.trace_hash(),
        len(history),
        history.now(),
        round(wall, 3),
        [str(a) for a in armed],
        cluster.faults.fired(),
        dict(oracles.metrics),
        implicated,
        signature(verdict, invariant, detail, strategy, implicated, crash),
        crash=crash,
    )
    result.spans = _spans(cluster.timeline.spans, history)
    # Each rank's NIXL progress-thread poll timeout (EPSIM_NIXL_PROGRESS_DELAY_US, read by each rank from its own
    # environment): [0] is vLLM's busy loop; more than one value only when torchrun slots on other hosts differ.
    result.metrics["nixl_progress_delay_us"] = sorted(
        {f["progress_delay_us"] for _, _, _, kind, f in cluster.events if kind == "nixl.config"}
    )
    # Slots on other hosts are on slot 0's clock only to within a bound: say how far, and whether the verdict
    # would change under another placement within it (none of these keys when every process read slot 0's clock).
    clocks = {pid: (w.clock, w.clock_bound) for pid, w in cluster.timeline.workers.items() if w.clock_bound > 0}
    if clocks:
        found = clock_sensitivity(
            cluster.events, cluster.t0, completed=cluster.completed, stuck=cluster.stuck, clocks=clocks
        )
        result.metrics["clock_bound_s"] = max(bound for _, bound in clocks.values())
        result.metrics["clock_sensitive"] = found.changed
        result.metrics["clock_placements"] = [found.tried, found.placements]  # judged, of those that reorder
    if out is not None:
        write_run_files(
            out,
            {
                "history.jsonl": history.write_jsonl,
                "trace.perfetto.json": lambda p: history.write_perfetto(p, result.spans),
                "result.json": lambda p: p.write_text(json.dumps(result.to_dict()) + "\n"),
            },
            result,
        )
    return result


def _spans(spans, history) -> list[list]:
    """The run's spans as the simulation's time model covers them.  A rebalance (and an elastic event's reshuffle)
    lasts as long as its slowest rank's EPLB step took on that rank (the load all-reduce and the layers' moves), not
    the parent's round trips and the harness's weight checks around it; an elastic event lasts as long as its phases
    together, as in the simulation, where they follow each other."""
    moved: list[tuple[float, float]] = []  # (when the rebalance began, its slowest rank's seconds)
    for t, kind, fields in history.records:
        if kind == "engine.rebalance":
            moved.append((t, 0.0))
        elif kind == "eplb.moved" and moved:
            moved[-1] = (moved[-1][0], max(moved[-1][1], fields["seconds"]))
    out: list[list] = []
    phases: dict[str, float] = {}  # event kind -> its phases' seconds so far
    for what, a, b in spans:
        if what == "rebalance" or what.endswith(".reshuffle"):
            # The rebalance this span is of: the last one begun by its start.
            began = [seconds for t, seconds in moved if t <= a + 1e-6]
            if began:
                b = a + began[-1]
        if "." in what:
            event, phase = what.split(".", 1)
            # (an event's first phase starts its sum afresh: an event that failed left its phases unsummed)
            phases[event] = (0.0 if phase == "prepare" else phases.get(event, 0.0)) + (b - a)
        elif what in phases:
            b = a + phases.pop(what)
        out.append([what, round(a, 6), round(b, 6)])
    return out
