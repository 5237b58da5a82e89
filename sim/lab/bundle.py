"""Failure bundles: a folder that reproduces one failing run by itself.

``failure.json`` holds the configuration (seed, strategy, profile, every armed fault as an explicit ``--fault``
string: swarm draws and the scenario's own faults included), the outcome to reproduce (verdict, signature, trace
hash), the versions it was found with and the commands that replay it.  Beside it: ``scenario.yaml`` (with its
``faults`` list emptied, since failure.json lists them all), the decision tape (``tape.json``), the event history
(``history.jsonl``) and the Perfetto trace.  The history and the tape come from running the configuration again
while writing the bundle, so writing a bundle also checks that the run is deterministic.
"""

from __future__ import annotations

import json
import platform
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import __version__
from .. import faults as fault_catalogue
from .. import scenario as scenario_mod
from ..errors import EpsimError, one_line, validation_line
from ..outputs import RUN_FILES

FORMAT = 1


class BundleError(EpsimError, ValueError):
    """A folder that is not a readable failure bundle."""


class _Config(BaseModel):
    """What a replay reads from failure.json's ``config`` (the other keys are for people)."""

    model_config = ConfigDict(strict=True)
    seed: int = Field(ge=0, le=2**63 - 1)
    strategy: str = Field(min_length=1)
    profile: str = Field(min_length=1)
    faults: list[str]


class _Outcome(BaseModel):
    signature: Optional[str]
    trace_hash: str


class _Stored(BaseModel):
    """The parts of failure.json that replay and shrink use, checked on load so that a damaged file costs one line."""

    config: _Config
    outcome: _Outcome


@dataclass
class Bundle:
    path: Path
    data: dict[str, Any]

    @property
    def config(self) -> dict[str, Any]:
        return self.data["config"]

    @property
    def expected(self) -> dict[str, Any]:
        return self.data["outcome"]

    def scenario(self):
        return scenario_mod.load(self.path / "scenario.yaml")

    def faults(self) -> list[fault_catalogue.Armed]:
        return [fault_catalogue.parse(f) for f in self.config["faults"]]


def _versions() -> dict[str, str]:
    out = {"epsim": __version__, "python": platform.python_version()}
    for name in ("numpy", "simpy", "greenlet", "torch"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a version we cannot read is left out
            pass
    return out


def slug(signature: str) -> str:
    """``exception:nixlNotFoundError|shared-agent|gc.late`` -> ``exception_nixlNotFoundError__shared-agent__gc.late``;
    a crash's root cause and function: ``exception:RuntimeError<-nixlBackendError@Comm.__init__|...`` ->
    ``exception_RuntimeError-from-nixlBackendError-in-Comm.__init____...``"""
    signature = signature.replace("<-", "-from-").replace("@", "-in-")
    parts = [p if p != "-" else "nofault" for p in signature.split("|")]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", "__".join(parts))[:120]


def write_config(
    path: Path, sc, *, seed: int, strategy: str, profile: str, faults: list[str], extra: dict[str, Any] | None = None
):
    """Run the configuration once more with its history written into ``path``, then write failure.json; returns
    the run's :class:`~sim.run.Result`.  A bundle already at ``path`` has its own files replaced; nothing else there
    is removed (the commands check the folder first, :func:`sim.outputs.bundle_dir`)."""
    from ..run import run_scenario

    path.mkdir(parents=True, exist_ok=True)
    bare = scenario_mod.with_overrides(sc, faults=[])
    scenario_mod.dump(bare, path / "scenario.yaml")
    result = run_scenario(bare, seed=seed, strategy=strategy, profile=profile, faults=list(faults), out=path)
    fault_args = " ".join(f"--fault {shlex.quote(f)}" for f in faults)
    data = {
        "format": FORMAT,
        "config": {
            "scenario": sc.name,
            "seed": seed,
            "strategy": strategy,
            "profile": profile,
            "faults": list(faults),
            "elastic_events": len(sc.timeline),
            "ranks": sc.ranks,
            "steps": sc.steps,
        },
        "outcome": {
            "verdict": result.verdict,
            "invariant": result.invariant,
            "detail": result.detail,
            "signature": result.signature,
            "trace_hash": result.trace_hash,
            "events": result.events,
            "implicated": result.implicated,
            "crash": result.crash,
        },
        "versions": _versions(),
        "replay": f"epsim replay {shlex.quote(str(path))}",
        "run": (
            f"epsim run {shlex.quote(str(path / 'scenario.yaml'))} --seed {seed} --strategy "
            f"{shlex.quote(strategy)} --profile {profile} {fault_args}"
        ).strip(),
        **(extra or {}),
    }
    (path / "failure.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return result


def write(spec, row: dict[str, Any], bundles_dir: Path) -> Path:
    """The bundle of a sweep's failing run ``row`` (its spec ``spec``), in ``bundles_dir``."""
    sc = spec.load_scenario()
    path = _free(Path(bundles_dir) / f"{slug(row['signature'])}-seed{spec.seed}")
    result = write_config(
        path,
        sc,
        seed=spec.seed,
        strategy=spec.strategy,
        profile=spec.profile,
        faults=list(row["faults_armed"]),
        extra={"found_by": {"run_key": row["run_key"], "trace_hash": row["trace_hash"]}},
    )
    if result.trace_hash != row["trace_hash"] or result.signature != row["signature"]:
        data = json.loads((path / "failure.json").read_text())
        data["nondeterministic"] = (
            f"the sweep's run gave {row['signature']} / {row['trace_hash']}, the run "
            f"that wrote this bundle {result.signature} / {result.trace_hash}"
        )
        (path / "failure.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def _free(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``... whichever does not exist yet: a bundle an earlier sweep left under the
    same name is what that sweep's database points at, so it is never replaced.  A folder a killed sweep left
    half-written (bundle files but no failure.json, which is written last) is nobody's: it is written again."""
    candidate, n = path, 1
    while candidate.exists() and not _half_written(candidate):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _half_written(path: Path) -> bool:
    if not path.is_dir() or (path / "failure.json").exists():
        return False
    return {p.name for p in path.iterdir()} <= {"scenario.yaml", *RUN_FILES}


def load(path: str | Path) -> Bundle:
    path = Path(path)
    meta = path / "failure.json"
    if not meta.is_file():
        raise BundleError(f"{path}: not a failure bundle (no failure.json)")
    try:
        data = json.loads(meta.read_text())
    except ValueError as exc:
        raise BundleError(f"{meta}: not valid JSON ({exc})") from None
    except RecursionError:
        raise BundleError(f"{meta}: nested deeper than a failure bundle ever is") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BundleError(f"{meta}: not a failure bundle of format {FORMAT}")
    try:
        _Stored.model_validate(data)
    except ValidationError as exc:
        raise BundleError(f"{meta}: {validation_line(exc)}") from None
    if not (path / "scenario.yaml").is_file():
        raise BundleError(f"{path}: scenario.yaml is missing")
    b = Bundle(path, data)
    try:
        b.faults()
    except EpsimError as exc:
        raise BundleError(f"{meta}: {exc}") from None
    recorded_tape(path)  # a damaged tape is refused before anything runs
    return b


def recorded_tape(path: Path) -> list | None:
    """The decisions of the bundle's ``tape.json`` (None without one); a file that is not such a tape is a
    :class:`BundleError`."""
    tape_file = path / "tape.json"
    if not tape_file.is_file():
        return None
    try:
        tape = json.loads(tape_file.read_text())
    except (OSError, ValueError) as exc:  # (a UnicodeDecodeError is a ValueError)
        raise BundleError(f"{tape_file}: not a readable tape ({one_line(str(exc))})") from None
    except RecursionError:
        raise BundleError(f"{tape_file}: not a readable tape (nested deeper than a tape ever is)") from None
    decisions = tape.get("decisions") if isinstance(tape, dict) else None
    if not isinstance(decisions, list) or not all(isinstance(d, list) and len(d) >= 3 for d in decisions):
        raise BundleError(f"{tape_file}: not a tape epsim wrote (no list of decisions)")
    return decisions


# What replaying needs (failure.json and scenario.yaml; the seed alone decides the run) and the run's tape of
# recorded decisions, kept for reading; the history and the trace are big and a replay writes them again.
CORPUS_FILES = ("failure.json", "scenario.yaml", "tape.json")


def save_to_corpus(path: str | Path, corpus: str | Path) -> Path:
    """Copy the bundle at ``path`` into the regression corpus folder ``corpus`` (the test suite replays every bundle
    there).  Only what a replay needs is kept, and its commands point at the copy."""
    b = load(path)
    target = Path(corpus) / b.path.name
    if target.resolve() == b.path.resolve():
        return target  # already in the corpus
    target.mkdir(parents=True, exist_ok=True)  # a bundle of that name there is replaced file by file
    for name in CORPUS_FILES:
        if (b.path / name).is_file():
            shutil.copyfile(b.path / name, target / name)
        elif (target / name).is_file():
            (target / name).unlink()  # the replaced bundle's, not this one's
    data = dict(b.data)
    data["replay"] = f"epsim replay {shlex.quote(str(target))}"
    data["run"] = data["run"].replace(str(b.path / "scenario.yaml"), shlex.quote(str(target / "scenario.yaml")))
    data.pop("shrunk_from", None)  # a path on the machine that shrank it
    (target / "failure.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return target


@dataclass
class Replay:
    bundle: Bundle
    result: Any  # sim.run.Result

    @property
    def same_signature(self) -> bool:
        from ..run import same_signature

        return same_signature(self.bundle.expected["signature"], self.result.signature)

    @property
    def same_trace(self) -> bool:
        return self.result.trace_hash == self.bundle.expected["trace_hash"]

    @property
    def reproduced(self) -> bool:
        return self.same_signature and self.same_trace

    def tape_divergence(self) -> str | None:
        """Where the replay's decisions first differ from the bundle's tape (``tape.json``), or None: the first
        decision that differs says which component's choices changed (a fault's, the collector's, a UUID)."""
        recorded = recorded_tape(self.bundle.path)
        if recorded is None:
            return None
        now = json.loads(json.dumps(getattr(self.result, "tape", []), default=str))
        for i, (was, is_) in enumerate(zip(recorded, now)):
            if was != is_:
                return (
                    f"decision {i + 1} of {len(recorded)}: the tape has {was[0]} {was[1]} {was[2]}, the replay "
                    f"drew {is_[0]} {is_[1]} {is_[2]}"
                )
        if len(recorded) != len(now):
            return f"the tape has {len(recorded)} decisions, the replay made {len(now)}"
        return None


def replay(path: str | Path, out: str | Path | None = None) -> Replay:
    b = load(path)  # before the simulation (and torch) is imported: a bad bundle is one line at once
    from ..run import run_scenario

    c = b.config
    result = run_scenario(
        b.scenario(), seed=c["seed"], strategy=c["strategy"], profile=c["profile"], faults=b.faults(), out=out
    )
    return Replay(b, result)
