"""``epsim conform``: the NIXL behaviour catalogue against one backend, run in a child process.

The child is ``python -m real_backends.probe --stream``: a crash of the real library (some 1.5.1 misuse segfaults)
cannot take the CLI down with it, and the real NIXL's global state never leaks into the caller.  The child reports
each case as it starts and ends, so a child that dies costs nothing already observed: the cases after the one it
died in run in a fresh child, and the one it died in runs once more on its own.  Real NIXL 1.5.1 has crashed a
process once in thousands of runs of an ordinary call sequence (docs/nixl-fake.md), so one death is a race to
report, not the case's behaviour; a case whose process dies twice observes the death (the signal's name), which is
then judged like any other observation.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

from fakes.conformance import CASES
from fakes.nixl.profiles import PROFILES

from real_backends.probe import UNAVAILABLE, default_profile, judge, summarise
from real_backends.rank import die_with_parent

from .errors import BackendUnavailable, UnknownName

BACKENDS = ("fake", "real")
MEMORIES = ("dram", "vram")
PROBE = (sys.executable, "-m", "real_backends.probe")


def validate(backend: str, profile: str | None, memory: str) -> None:
    if backend not in BACKENDS:
        raise UnknownName(f"backend {backend!r} not known; use one of: {', '.join(BACKENDS)}")
    if profile is not None and profile not in PROFILES:
        raise UnknownName(f"profile {profile!r} not known; known: {', '.join(PROFILES)}")
    if memory not in MEMORIES:
        raise UnknownName(f"memory {memory!r} not known; use one of: {', '.join(MEMORIES)}")


def run(backend: str, profile: str | None, memory: str, timeout_s: float = 1800,
        probe: tuple[str, ...] = PROBE) -> dict[str, Any]:
    """The catalogue's report (``real_backends.probe.summarise``) with ``notes``: one line per child that died.

    ``probe`` is the child's command line before its arguments (a test gives one that dies on purpose)."""
    validate(backend, profile, memory)
    chosen = default_profile(profile, memory)
    deadline = time.monotonic() + timeout_s
    results: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    died_once: set[str] = set()
    while len(results) < len(CASES):
        left = [name for name in CASES if name not in results]
        # a case that killed its child once runs alone, so a second death is that case's and nothing else's
        batch = left[:1] if left[0] in died_once else left
        finished, starting, death = _play(probe, backend, chosen, memory, batch, deadline, timeout_s)
        results.update(finished)
        if death is None:
            continue
        if starting is None and finished:  # it died between two cases: count it against the next one
            starting = next(name for name in batch if name not in finished)
        if starting is None:
            raise BackendUnavailable(f"the conformance run on {backend} NIXL produced no result: {death}")
        if starting in died_once:
            notes.append(f"{starting}: its process died again ({death}) when run alone; that is its observation")
            results[starting] = judge({"name": starting, "observed": death}, chosen, hardware=backend == "real")
        else:
            died_once.add(starting)
            notes.append(f"{starting}: the catalogue's process died in it ({death}); the case runs again alone, "
                         "and the cases after it in a fresh process")
    report = summarise([results[name] for name in CASES], backend, profile, memory.upper())
    report["notes"] = notes
    return report


def _play(probe: tuple[str, ...], backend: str, profile: str, memory: str, names: list[str], deadline: float,
          timeout_s: float) -> tuple[dict[str, dict[str, Any]], str | None, str | None]:
    """Run ``names`` in one child: (results by name, the case it was in when it ended, how it died or None)."""
    cmd = [*probe, "--backend", backend, "--profile", profile, "--memory", memory, "--stream"]
    for name in names:
        cmd += ["--case", name]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()),
                              preexec_fn=die_with_parent)
    except subprocess.TimeoutExpired:
        raise BackendUnavailable(f"the conformance run on {backend} NIXL did not finish within {timeout_s:g} s") \
            from None
    finished: dict[str, dict[str, Any]] = {}
    starting = None
    for line in done.stdout.splitlines():
        if not line.startswith("{"):
            continue
        msg = json.loads(line)
        if "starting" in msg:
            starting = msg["starting"]
        elif "case" in msg:
            finished[msg["case"]["name"]] = msg["case"]
            starting = None
    if all(name in finished for name in names):
        return finished, None, None
    tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    if starting is None and done.returncode == UNAVAILABLE:
        raise BackendUnavailable(tail.removeprefix("error: "))
    if done.returncode < 0:
        death = signal.Signals(-done.returncode).name
    else:
        death = f"exit {done.returncode}: {tail}"
    return finished, starting, death
