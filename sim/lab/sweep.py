"""Sweeps: the cross product of seeds, strategies and profiles of one scenario, run on an engine, stored as they
finish, with a failure bundle for every new failure signature.

A run is described by a :class:`RunSpec` that carries the scenario's YAML itself, so a sweep does not depend on a
file that changes while it runs and a worker process (or a Ray node) needs nothing but the spec.  Its ``key`` is a
digest of everything that decides the run's outcome; the database refuses a second row with the same key, which is
what makes ``--resume`` exact.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from .. import faults as fault_catalogue
from .. import scenario as scenario_mod
from ..errors import ScenarioError, refuse_empty

SIM_VERDICTS = ("pass", "safety", "liveness", "crash")  # what a simulated run can be judged
RUN_FAILURES = ("error", "timeout", "worker_crash")  # what can happen to the run itself


@dataclass(frozen=True)
class RunSpec:
    scenario: str  # its name, for people
    scenario_yaml: str
    seed: int
    strategy: str
    profile: str
    faults: tuple[str, ...] = ()
    swarm: bool = False

    @property
    def scenario_digest(self) -> str:
        return hashlib.sha256(self.scenario_yaml.encode()).hexdigest()[:16]

    @property
    def key(self) -> str:
        body = json.dumps([self.scenario_digest, self.seed, self.strategy, self.profile, list(self.faults), self.swarm])
        return hashlib.sha256(body.encode()).hexdigest()[:24]

    def load_scenario(self):
        return scenario_mod.from_dict(yaml.safe_load(self.scenario_yaml), self.scenario)


MAX_SEED = 2**63 - 1  # SQLite's INTEGER
MAX_RUNS = 1_000_000  # the plan is held in memory (about a kilobyte per run); a sweep that size takes hours anyway


def parse_seeds(text: str) -> range:
    """``A:B`` (B excluded, as Python's ranges) or a single seed ``N``."""
    found = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    if not found:
        raise ScenarioError(f"--seeds {text!r}: give A:B (seeds A to B-1) or one seed N")
    lo = int(found.group(1))
    hi = int(found.group(2)) if found.group(2) is not None else lo + 1
    if hi <= lo:
        raise ScenarioError(f"--seeds {text!r}: B must be greater than A")
    if hi - 1 > MAX_SEED:
        raise ScenarioError(f"--seeds {text!r}: seeds go up to {MAX_SEED} (what the results database stores)")
    if hi - lo > MAX_RUNS:
        raise ScenarioError(
            f"--seeds {text!r}: {hi - lo} seeds; one sweep plans at most {MAX_RUNS:,} runs, so split "
            f"it (--resume continues a database)"
        )
    return range(lo, hi)


def plan(
    scenario_ref: str,
    seeds: range,
    strategies: Iterable[str] = (),
    profiles: Iterable[str] = (),
    faults: Iterable[str] = (),
    swarm: bool = False,
) -> list[RunSpec]:
    """Every run of the sweep, in a fixed order (seed-major, so early results cover every configuration)."""
    from fakes.nixl.profiles import PROFILES

    from ..eplb.communicators import plugins

    sc = scenario_mod.load(scenario_ref)
    text = scenario_mod.to_yaml(sc)
    for option, values in (("--strategy", strategies), ("--profile", profiles)):
        refuse_empty(option, values)
    strategies = list(dict.fromkeys(strategies)) or [sc.strategy]
    profiles = list(dict.fromkeys(profiles)) or [sc.profile]
    for p in profiles:
        if p not in PROFILES:
            raise ScenarioError(f"profile {p!r} not found; known: {', '.join(PROFILES)}")
    for s in strategies:
        # A missing or broken strategy is one line now, not two thousand failed runs.  A built-in one is known to
        # load: loading it here would import torch into the sweep's own process, which runs no simulation.
        if s not in plugins.BUILTIN:
            plugins.load(s)
    armed = [fault_catalogue.parse(f) for f in faults]
    fault_catalogue.check_fits(armed, sc)
    fault_catalogue.arm(sc.faults, armed)  # with the scenario's own: none armed twice
    faults = tuple(str(a) for a in armed)  # checked, and written one way
    if len(seeds) * len(strategies) * len(profiles) > MAX_RUNS:
        raise ScenarioError(
            f"{len(seeds)} seeds x {len(strategies)} strategies x {len(profiles)} profiles: one sweep "
            f"plans at most {MAX_RUNS:,} runs, so split it (--resume continues a database)"
        )
    return [
        RunSpec(sc.name, text, seed, strategy, profile, faults, swarm)
        for seed in seeds
        for strategy in strategies
        for profile in profiles
    ]


# -- one run, wherever it executes --------------------------------------------------------------------------------
def armed_faults(spec: RunSpec, sc) -> list[fault_catalogue.Armed]:
    armed = [fault_catalogue.parse(f) for f in spec.faults]
    if spec.swarm:
        from . import swarm

        given = {str(a) for a in armed} | {str(a) for a in fault_catalogue.arm(sc.faults)}
        armed = [a for a in swarm.draw(sc, spec.seed) if str(a) not in given] + armed  # a draw the run arms anyway
    return armed


def execute(spec: RunSpec, out: str | Path | None = None) -> dict[str, Any]:
    """Run ``spec`` and return its database row.  Anything the harness itself raises is an ``error`` row."""
    from ..run import run_scenario

    started = time.perf_counter()
    try:
        sc = spec.load_scenario()
        result = run_scenario(
            sc, seed=spec.seed, strategy=spec.strategy, profile=spec.profile, faults=armed_faults(spec, sc), out=out
        )
    except Exception as exc:  # noqa: BLE001 - recorded, and the sweep goes on
        return failed_row(spec, "error", f"{type(exc).__name__}: {exc}", time.perf_counter() - started)
    row = base_row(spec)
    row.update(
        verdict=result.verdict,
        invariant=result.invariant,
        detail=result.detail,
        signature=result.signature,
        trace_hash=result.trace_hash,
        events=result.events,
        sim_time_s=result.sim_time_s,
        wall_s=result.wall_s,
        faults_armed=result.faults_armed,
        faults_fired=result.faults_fired,
        implicated=result.implicated,
        metrics=result.metrics,
    )
    return row


def base_row(spec: RunSpec) -> dict[str, Any]:
    return {
        "run_key": spec.key,
        "scenario": spec.scenario,
        "scenario_digest": spec.scenario_digest,
        "seed": spec.seed,
        "strategy": spec.strategy,
        "profile": spec.profile,
        "faults_requested": list(spec.faults),
        "swarm": int(spec.swarm),
        "faults_armed": list(spec.faults),
        "faults_fired": {},
        "implicated": [],
        "metrics": {},
        "finished_at": time.time(),
    }


def failed_row(spec: RunSpec, verdict: str, detail: str, wall_s: float) -> dict[str, Any]:
    """The row of a run that did not finish: it raised, hung past the timeout, or took its process down."""
    row = base_row(spec)
    row.update(
        verdict=verdict,
        invariant=verdict,
        detail=detail,
        signature=f"{verdict}|{spec.strategy}|-",
        wall_s=round(wall_s, 3),
    )
    return row


def replay_command(bundle: str | Path) -> str:
    return f"epsim replay {shlex.quote(str(bundle))}"


def spec_dict(spec: RunSpec) -> dict[str, Any]:
    return asdict(spec)


# -- the sweep ------------------------------------------------------------------------------------------------------
@dataclass
class SweepOutcome:
    planned: int
    skipped: int  # already in the database (--resume)
    ran: int
    verdicts: dict[str, int]
    new_signatures: list[str]
    bundles: list[str]
    wall_s: float


def run_sweep(
    specs: list[RunSpec],
    db,
    engine,
    *,
    resume: bool,
    bundles_dir: Path,
    command: str,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> SweepOutcome:
    from . import bundle as bundle_mod

    started = time.time()
    stored = db.keys()
    todo = [s for s in specs if s.key not in stored]
    skipped = len(specs) - len(todo)
    if skipped and not resume:
        raise ScenarioError(
            f"{db.path} already holds {skipped} of these {len(specs)} runs; pass --resume to run "
            "only the missing ones, or another --db"
        )
    sweep_id = db.new_sweep(command, len(specs), started)
    bundled = db.bundled_signatures()
    verdicts: dict[str, int] = {}
    new_signatures: list[str] = []
    bundles: list[str] = []
    by_key = {s.key: s for s in todo}
    ran = 0
    bundles_dir = Path(bundles_dir).absolute()  # the database's paths hold from any working directory
    for row in engine.map(todo):
        row["sweep_id"] = sweep_id
        sig = row.get("signature")
        if sig and row["verdict"] in SIM_VERDICTS and sig not in bundled:
            # Asked again now, not only at the start: another sweep on this database may have bundled it since
            # (two concurrent sweeps must not each bundle every signature; the window is one bundle's writing, not
            # the whole sweep).
            bundled |= db.bundled_signatures()
            if sig not in bundled:
                # The bundle first, then the row that points at it: a sweep killed in between has not stored the
                # run, so --resume runs it again and bundles it (into the folder left half-written, see
                # bundle._free).
                path = bundle_mod.write(by_key[row["run_key"]], row, bundles_dir)
                row["bundle"] = str(path)
        if not db.add(row):  # another sweep on this database stored the run first
            continue
        if row.get("bundle"):
            bundled.add(sig)
            new_signatures.append(sig)
            bundles.append(row["bundle"])
        ran += 1
        verdicts[row["verdict"]] = verdicts.get(row["verdict"], 0) + 1
        if on_result is not None:
            on_result(row)
    return SweepOutcome(len(specs), skipped, ran, verdicts, new_signatures, bundles, time.time() - started)
