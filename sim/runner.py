"""What ``epsim run`` does around a run: load, validate, run, optionally rerun in a fresh process, summarise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from . import scenario as scenario_mod
from .run import Result, run_scenario


def run_command(name: str, *, seed, strategy, profile, faults, out, check_determinism) -> tuple[Result, str | None]:
    from .progress import RunProgress

    sc = scenario_mod.load(name)
    with RunProgress(sc.name, sc.steps) as progress:
        result = run_scenario(sc, seed=seed, strategy=strategy, profile=profile, faults=list(faults), out=out,
                              on_progress=progress)
    again = None
    if check_determinism:
        again = rerun_hash(name, result, faults)
    return result, again


def rerun_hash(name: str, result: Result, faults) -> str:
    """The trace hash of the same run in a fresh interpreter with a different PYTHONHASHSEED."""
    cmd = [sys.executable, "-m", "sim.cli", "run", name, "--seed", str(result.seed), "--strategy", result.strategy,
           "--profile", result.profile, "--json"]
    for f in faults:
        cmd += ["--fault", f]
    env = dict(os.environ, PYTHONHASHSEED=str((int(os.environ.get("PYTHONHASHSEED", "0") or 0) + 12345) % 4294967295))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return f"rerun failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}"
    return json.loads(lines[-1])["trace_hash"]


def summary(r: Result, again: str | None = None) -> str:
    lines = [f"{r.scenario} · {r.strategy} · {r.profile} · seed {r.seed}",
             f"verdict: {r.verdict}" + (f" ({r.invariant}) {r.detail}" if r.verdict != "pass" else ""),
             f"trace {r.trace_hash}: {r.events} events, {r.sim_time_s:.1f} s simulated in {r.wall_s:.2f} s"]
    if r.faults_armed:
        fired = ", ".join(f"{k} fired {v}x" for k, v in r.faults_fired.items())
        lines.append(f"faults: {fired}")
    m = r.metrics
    lines.append(f"agents created {m.get('agents_created', 0)}, max live per process "
                 f"{m.get('max_live_agents_per_process', 0)}, duplicate registrations "
                 f"{m.get('duplicate_registrations', 0)}, transfers {m.get('transfers', 0)}")
    if again is not None:
        lines.append(f"determinism: rerun in a fresh process gave {again} "
                     + ("(same)" if again == r.trace_hash else "(DIFFERENT)"))
    return "\n".join(lines)
