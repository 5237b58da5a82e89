"""What ``epsim run`` does around a run: load, validate, run, optionally rerun in a fresh process, summarise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from . import faults as fault_catalogue
from . import scenario as scenario_mod
from .errors import ScenarioError, refuse_empty
from .result import Result


REAL_TIMEOUT_S = 120.0  # seconds a real rank may take to answer one command, unless --timeout says otherwise


def run_command(
    name: str,
    *,
    seed,
    strategy,
    profile,
    faults,
    out,
    check_determinism,
    overrides=(),
    backend: str = "sim",
    device: str = "cpu",
    timeout_s: float | None = None,
    calibration: str | None = None,
    ranks_per_host: int | None = None,
) -> tuple[Result, str | None]:
    from .progress import RunProgress

    sc = scenario_mod.load(name)
    if overrides:
        sc = scenario_mod.with_overrides(sc, **parse_overrides(overrides))
    for option, value in (("--strategy", strategy), ("--profile", profile)):
        refuse_empty(option, [value] if value is not None else [])
    fault_catalogue.check_fits([fault_catalogue.parse(f) for f in faults], sc)
    if backend == "real":
        if calibration is not None:
            raise ScenarioError("--calibration sets the simulation's time model; a real run takes the host's time")
        if profile is not None:
            raise ScenarioError("--profile picks a fake NIXL's behaviour; the real backend is the library itself")
        if check_determinism:
            raise ScenarioError("--check-determinism compares simulated runs; a real run's timing is the host's")
        from real_backends.launch import TorchrunLauncher, under_torchrun
        from real_backends.run import run_real

        # Slot 0 of a torchrun job runs the engine; the other slots never get here (`epsim run` serves them).
        launcher = TorchrunLauncher(ranks_per_host) if under_torchrun() else None
        with RunProgress(sc.name, sc.steps) as progress:
            return run_real(
                sc,
                seed=seed,
                strategy=strategy,
                faults=list(faults),
                device=device,
                timeout_s=REAL_TIMEOUT_S if timeout_s is None else timeout_s,
                out=out,
                on_progress=progress,
                launcher=launcher,
                ranks_per_host=ranks_per_host,
            ), None
    if backend != "sim":
        raise ScenarioError(f"--backend {backend!r}: use sim or real")
    if timeout_s is not None:
        raise ScenarioError(
            "--timeout bounds a real rank's answer; a simulation's collectives time out in "
            "simulated time (collective_timeout_s)"
        )
    if ranks_per_host is not None:
        raise ScenarioError("--ranks-per-host places real rank processes; a simulation has no hosts")
    if device != "cpu":
        raise ScenarioError("--device is for --backend real; a simulation places nothing on a device")
    timing = None
    if calibration is not None:
        from .calibration import load as load_calibration

        timing = load_calibration(calibration)
        if timing.quick:  # usable (the run goes on), but the user should know what the times rest on
            print(
                f"epsim: warning: calibration {calibration} was measured with `epsim calibrate --quick` (three "
                f"sizes, a few repeats): a check that the path works, not times to trust",
                file=sys.stderr,
            )
    from .run import run_scenario  # the simulation (torch with it), once the arguments are known to be good

    with RunProgress(sc.name, sc.steps) as progress:
        # tidy=False: `epsim run` exits right after the verdict (os._exit), so the simulated world is never
        # finalized; collecting it first would add a second at DeepSeek scale.
        result = run_scenario(
            sc,
            seed=seed,
            strategy=strategy,
            profile=profile,
            faults=list(faults),
            out=out,
            on_progress=progress,
            calibration=timing,
            tidy=False,
        )
    again = None
    if check_determinism:
        again = rerun_hash(name, result, faults, overrides, calibration)
    return result, again


def parse_overrides(items) -> dict:
    """``--set KEY=VALUE`` items (``ranks=3``, ``timeline.0.to=2``, ``eplb.step_interval=400``) as a mapping for
    :func:`sim.scenario.with_overrides`; values are YAML scalars."""
    import yaml

    out = {}
    for item in items:
        key, eq, raw = item.partition("=")
        shown = repr(item if len(item) <= 80 else item[:60] + "...")  # the one line stays readable
        if not eq or not key.strip():
            raise ScenarioError(f"--set {shown}: write KEY=VALUE, for example ranks=3 or timeline.0.to=2")
        if not raw.strip():
            raise ScenarioError(f"--set {shown}: no value; write {key.strip()}=null for none")
        try:
            out[key.strip()] = scenario_mod.load_value(raw)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or "not a YAML value"
            raise ScenarioError(f"--set {shown}: the value is not a YAML scalar or list ({problem})") from None
    return out


def rerun_hash(name: str, result: Result, faults, overrides=(), calibration: str | None = None) -> str:
    """The trace hash of the same run in a fresh interpreter with a different PYTHONHASHSEED."""
    cmd = [
        sys.executable,
        "-m",
        "sim.cli",
        "run",
        name,
        "--seed",
        str(result.seed),
        "--strategy",
        result.strategy,
        "--profile",
        result.profile,
        "--json",
    ]
    for f in faults:
        cmd += ["--fault", f]
    for item in overrides:
        cmd += ["--set", item]
    if calibration is not None:
        cmd += ["--calibration", calibration]
    own = os.environ.get("PYTHONHASHSEED", "0")
    own_seed = int(own) if own.isdigit() else 0  # "random" (or unset) is a valid setting: any fixed other value does
    env = dict(os.environ, PYTHONHASHSEED=str((own_seed + 12345) % 4294967295))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return f"rerun failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}"
    return json.loads(lines[-1])["trace_hash"]


def summary(r: Result, again: str | None = None) -> str:
    lines = [
        f"{r.scenario} · {r.strategy} · {r.profile} · seed {r.seed}",
        f"verdict: {r.verdict}" + (f" ({r.invariant}) {r.detail}" if r.verdict != "pass" else ""),
        f"trace {r.trace_hash}: {r.events} events, {r.sim_time_s:.1f} s simulated in {r.wall_s:.2f} s"
        if not r.profile.startswith("real-")
        else f"{r.events} events in {r.wall_s:.2f} s on real rank processes (wall clock: no trace hash to compare)",
    ]
    if r.verdict == "crash" and r.crash:
        from .crash import readable

        lines[2:2] = readable(r.crash)  # under the verdict: the exception chain and where it was raised
    if r.faults_armed:
        fired = ", ".join(f"{k} fired {v}x" for k, v in r.faults_fired.items())
        lines.append(f"faults: {fired}")
    m = r.metrics
    lines.append(
        f"agents created {m.get('agents_created', 0)}, max live per process "
        f"{m.get('max_live_agents_per_process', 0)}, duplicate registrations "
        f"{m.get('duplicate_registrations', 0)}, transfers {m.get('transfers', 0)}"
    )
    if any(m.get("nixl_progress_delay_us", ())):
        lines.append(
            f"NIXL progress threads: poll timeout {', '.join(map(str, m['nixl_progress_delay_us']))} us "
            f"(EPSIM_NIXL_PROGRESS_DELAY_US; vLLM's own configuration busy-polls)"
        )
    if "clock_bound_s" in m:
        lines.append(_clock_line(m))
    if again is not None:
        lines.append(
            f"determinism: rerun in a fresh process gave {again} "
            + ("(same)" if again == r.trace_hash else "(DIFFERENT)")
        )
    return "\n".join(lines)


def _clock_line(m: dict) -> str:
    """What a real run with slots on other hosts says of its clocks (real_backends/ordering.py)."""
    line = f"slots on other hosts are on slot 0's clock to within {m['clock_bound_s'] * 1e3:.3f} ms"
    tried, placements = m.get("clock_placements", (0, 0))
    if not placements:
        return f"{line}; no two hosts' checked events lie that close: the verdict does not depend on the placement"
    of = f"{tried} placements" + (f" (of {placements}: the rest not judged)" if tried < placements else "")
    changed = m["clock_sensitive"]
    if not changed:
        return f"{line}; the verdict holds under each of {of} that reorder the events"
    shown = "; with ".join(changed[:3]) + (
        f"; and {len(changed) - 3} more (metrics.clock_sensitive)" if len(changed) > 3 else ""
    )
    return f"{line}; the verdict DEPENDS on that placement ({len(changed)} of {of} change it): with {shown}"
