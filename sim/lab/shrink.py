"""Shrinking a failure bundle: the smallest configuration that still fails with the same signature.

Plain delta debugging over the run's configuration, the choices that make up its tape: armed faults, elastic
events, ranks, layers and steps.  Each pass tries to take something away (half of the faults at once, then one at a
time; each elastic event; one rank; half the layers; half or a quarter of the steps), runs the candidate with the
same seed, and keeps it if the failure signature is unchanged.  Candidates the scenario schema refuses (a scale-down
below what exists) are skipped without a run.  Passes repeat until none removes anything or the run budget is
spent; every run is deterministic, so the result is too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from . import bundle as bundle_mod
from .. import scenario as scenario_mod
from ..errors import ScenarioError


@dataclass
class Candidate:
    scenario: Any  # sim.scenario.Scenario
    faults: list[str]
    change: str  # what this candidate removed, for people

    def size(self) -> tuple[int, int, int, int, int]:
        sc = self.scenario
        return (len(self.faults), len(sc.timeline), sc.peak_ranks(), sc.model.layers, sc.steps)


@dataclass
class ShrinkResult:
    original: Candidate
    final: Candidate
    removed: list[str] = field(default_factory=list)
    runs: int = 0
    bundle: Path | None = None
    last_signature: str | None = None  # the last candidate run's


class NotReproduced(RuntimeError):
    """The bundle's own configuration does not fail as the bundle says (another version, a changed strategy)."""


def _variant(sc, **changes: Any):
    try:
        return scenario_mod.with_overrides(sc, **changes)
    except ScenarioError:
        return None


def _candidates(cur: Candidate) -> Iterator[Candidate]:
    sc, faults = cur.scenario, cur.faults
    if len(faults) > 1:
        half = len(faults) // 2
        yield Candidate(sc, faults[half:], f"faults {', '.join(faults[:half])}")
        yield Candidate(sc, faults[:half], f"faults {', '.join(faults[half:])}")
    for i, f in enumerate(faults):
        yield Candidate(sc, faults[:i] + faults[i + 1 :], f"fault {f}")
    events = [e.model_dump(mode="python") for e in sc.timeline]
    for i in reversed(range(len(events))):
        v = _variant(sc, timeline=events[:i] + events[i + 1 :])
        if v is not None:
            e = events[i]
            yield Candidate(v, faults, f"elastic event {e['kind']} at step {e['at_step']}")
    if events and events[0]["kind"] in ("scale_up", "scale_down"):  # start where the first change would end
        first = events[0]
        v = _variant(sc, ranks=first["to"], timeline=events[1:])
        if v is not None:
            yield Candidate(
                v,
                faults,
                f"elastic event {first['kind']} at step {first['at_step']} (starting at EP{first['to']} instead)",
            )
    for i in range(len(events) - 1):  # a change undone by the next one
        v = _variant(sc, timeline=events[:i] + events[i + 2 :])
        if v is not None:
            yield Candidate(
                v,
                faults,
                f"elastic events {events[i]['kind']} at step {events[i]['at_step']} and "
                f"{events[i + 1]['kind']} at step {events[i + 1]['at_step']}",
            )
    for i, e in enumerate(events):  # a smaller change
        if e["kind"] in ("scale_up", "scale_down") and e["to"] > 1:
            smaller = dict(e, to=e["to"] - 1)
            v = _variant(sc, timeline=events[:i] + [smaller] + events[i + 1 :])
            if v is not None:
                yield Candidate(v, faults, f"one rank of the {e['kind']} at step {e['at_step']} (to EP{e['to'] - 1})")
    if sc.ranks > 1:
        v = _variant(sc, ranks=sc.ranks - 1)
        if v is not None:
            yield Candidate(v, faults, f"one rank (EP{sc.ranks} -> EP{sc.ranks - 1} at start)")
    if sc.model.layers > 1:
        layers = max(1, sc.model.layers // 2)
        v = _variant(sc, model={"layers": layers})
        if v is not None:
            yield Candidate(v, faults, f"{sc.model.layers - layers} of {sc.model.layers} layers")
    for steps in (sc.steps // 2, sc.steps * 3 // 4):
        if 1 <= steps < sc.steps:
            v = _variant(sc, steps=steps)
            if v is not None:
                yield Candidate(v, faults, f"{sc.steps - steps} of {sc.steps} steps")


def default_target(path: str | Path) -> Path:
    """Where a shrunk bundle goes without ``--out``: beside the bundle, its name with ``-shrunk`` appended."""
    path = Path(path)
    if path.name in ("", ".", ".."):  # "." from inside the bundle: its real name
        path = path.resolve()
    return path.with_name(path.name + "-shrunk")


def _shrunk_description(original, removed: list[str]) -> str:
    before = f" ({original.description.strip()})" if original.description.strip() else ""
    return f"{original.name}{before}, shrunk by epsim shrink, which took away: {'; '.join(removed)}"


def shrink(
    path: str | Path,
    out: str | Path | None = None,
    *,
    max_runs: int = 200,
    on_step: Callable[[str, bool], None] | None = None,
) -> ShrinkResult:
    """Shrink the bundle at ``path``; the smallest failing configuration is written as a new bundle at ``out``
    (default: the bundle's folder with ``-shrunk`` appended)."""
    from ..run import run_scenario, same_signature

    b = bundle_mod.load(path)
    c = b.config
    want = b.expected["signature"]
    if want is None:  # a bundle of a run that passed: shrinking would keep whatever still passes
        raise NotReproduced(f"{b.path}: its run passed (no failure signature), so there is no failure to shrink")
    seed, strategy, profile = c["seed"], c["strategy"], c["profile"]
    cur = Candidate(b.scenario(), list(c["faults"]), "")
    result = ShrinkResult(original=cur, final=cur)

    def fails_the_same(cand: Candidate) -> bool:
        result.runs += 1
        r = run_scenario(cand.scenario, seed=seed, strategy=strategy, profile=profile, faults=list(cand.faults))
        result.last_signature = r.signature
        return same_signature(want, r.signature)

    if not fails_the_same(cur):  # no failure to keep: every candidate would be refused, and the bundle is stale
        raise NotReproduced(
            f"{b.path} no longer fails as {want}: the run gives {result.last_signature}; "
            f"`epsim replay {b.path}` shows the run"
        )
    progress = True
    while progress and result.runs < max_runs:
        progress = False
        for cand in _candidates(cur):
            if result.runs >= max_runs:
                break
            kept = fails_the_same(cand)
            if on_step is not None:
                on_step(cand.change, kept)
            if kept:
                cur = cand
                result.removed.append(cand.change)
                progress = True
                break  # candidates are recomputed from the smaller configuration
    result.final = cur
    target = Path(out) if out is not None else default_target(b.path)
    written = cur.scenario
    if result.removed:  # the original's description ("EP2 grows to EP4") no longer says what this one runs
        written = scenario_mod.with_overrides(
            written, description=_shrunk_description(result.original.scenario, result.removed)
        )
    bundle_mod.write_config(
        target,
        written,
        seed=seed,
        strategy=strategy,
        profile=profile,
        faults=cur.faults,
        extra={"shrunk_from": str(b.path), "removed": result.removed, "shrink_runs": result.runs},
    )
    result.bundle = target
    return result
