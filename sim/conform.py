"""``epsim conform``: the NIXL behaviour catalogue against one backend, run in a child process.

The child is ``python -m real_backends.probe --stream``: a crash of the real library (some 1.5.1 misuse segfaults)
cannot take the CLI down with it, and the real NIXL's global state never leaks into the caller.  The child reports
each case as it starts and ends, so a child that dies costs nothing already observed: the cases after the one it
died in run in a fresh child, and the one it died in runs once more on its own.  Real NIXL 1.5.1 has crashed a
process once in thousands of runs of an ordinary call sequence (docs/nixl-fake.md), so one death is a race to
report, not the case's behaviour; a case whose process dies twice observes the death (the signal's name), which is
then judged like any other observation.  A child that reports nothing for five minutes (a case that hangs) is killed
and counts as dying in that case.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fakes.conformance import CASES
from fakes.nixl.profiles import PROFILES

from real_backends.probe import UNAVAILABLE, default_profile, judge, summarise
from real_backends.rank import die_with_parent

from .errors import BackendUnavailable, UnknownName

BACKENDS = ("fake", "real")
MEMORIES = ("dram", "vram")
PROBE = (sys.executable, "-m", "real_backends.probe")
# The longest one case may take before its child counts as hung: the slowest real cases (a peer killed mid-READ, a
# progress thread left to time out) take seconds; a GPU host's first CUDA context tens of seconds.
CASE_TIMEOUT_S = 300.0
# The longest a child may take to announce its first case: its imports and its backend's start (torch, NIXL's
# agent, UCX).  Kept apart from the per-case bound so that a tight bound (a test's, a user's) does not read a
# start-up slowed by a loaded machine as a hang in the first case.
START_TIMEOUT_S = 120.0


def validate(backend: str, profile: str | None, memory: str) -> None:
    if backend not in BACKENDS:
        raise UnknownName(f"backend {backend!r} not known; use one of: {', '.join(BACKENDS)}")
    if profile is not None and profile not in PROFILES:
        raise UnknownName(f"profile {profile!r} not known; known: {', '.join(PROFILES)}")
    if memory not in MEMORIES:
        raise UnknownName(f"memory {memory!r} not known; use one of: {', '.join(MEMORIES)}")


def run(
    backend: str,
    profile: str | None,
    memory: str,
    timeout_s: float = 1800,
    probe: tuple[str, ...] = PROBE,
    case_timeout_s: float = CASE_TIMEOUT_S,
    start_timeout_s: float = START_TIMEOUT_S,
) -> dict[str, Any]:
    """The catalogue's report (``real_backends.probe.summarise``) with ``notes``: one line per child that died.

    ``probe`` is the child's command line before its arguments (a test gives one that dies on purpose); a child
    that reports nothing for ``case_timeout_s`` (a case that hangs), or nothing at all for ``start_timeout_s`` after
    it started, is killed, as if it had died in that case."""
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
        child = _play(
            probe, backend, chosen, memory, batch, deadline, timeout_s, len(results), start_timeout_s, case_timeout_s
        )
        results.update(child.finished)
        if child.death is None:
            continue
        if child.started is not None:
            victim, where = child.started, "in it"
        elif not results and not died_once:  # nothing observed at all: the backend cannot run the catalogue here
            raise BackendUnavailable(
                f"the conformance run on {backend} NIXL produced no result: {child.death}{child.said}"
            )
        else:  # before its first case, or between two: counted against the next one, which was never started
            victim = next(name for name in batch if name not in child.finished)
            where = "before it started" + (f" (after {child.last})" if child.last else "")
        if victim in died_once:
            notes.append(
                f"{victim}: its process died again {where}, run alone ({child.death}{child.said}); "
                "that is its observation"
            )
            results[victim] = judge({"name": victim, "observed": child.death}, chosen, hardware=backend == "real")
        else:
            died_once.add(victim)
            notes.append(
                f"{victim}: the catalogue's process died {where} ({child.death}{child.said}); it runs "
                "again alone, and the cases after it in a fresh process"
            )
    report = summarise([results[name] for name in CASES], backend, profile, memory.upper())
    report["notes"] = notes
    return report


@dataclass
class _Ended:
    """How one child ended: the results it printed, the case it had started and not finished (if any), the last
    case it finished, and ``death`` (``SIGSEGV``, ``exit 5``; None when it ran every case) with ``said``, the
    last line of its stderr after an exit with a status (``": ..."``, or empty)."""

    finished: dict[str, dict[str, Any]] = field(default_factory=dict)
    started: str | None = None
    last: str | None = None
    death: str | None = None
    said: str = ""


def _play(
    probe: tuple[str, ...],
    backend: str,
    profile: str,
    memory: str,
    names: list[str],
    deadline: float,
    timeout_s: float,
    observed: int,
    start_timeout_s: float,
    case_timeout_s: float,
) -> _Ended:
    """Run ``names`` in one child, reading its cases as it reports them.  A child silent for too long (for
    ``start_timeout_s`` before its first line, then ``case_timeout_s`` between two) is killed and reads as a death,
    like a crash."""
    cmd = [*probe, "--backend", backend, "--profile", profile, "--memory", memory, "--stream"]
    for name in names:
        cmd += ["--case", name]
    if deadline - time.monotonic() <= 0:
        raise _out_of_time(backend, timeout_s, observed)
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    lines: queue.Queue[str | None] = queue.Queue()
    last_words: deque[str] = deque(maxlen=5)  # its stderr's last lines (the rest is a library's chatter)
    readers = [
        threading.Thread(target=_drain, args=(child.stdout, lines.put, True), daemon=True),
        threading.Thread(target=_drain, args=(child.stderr, last_words.append), daemon=True),
    ]
    for reader in readers:
        reader.start()
    ended, hung = _Ended(), False
    quiet_until, allowed = time.monotonic() + start_timeout_s, start_timeout_s
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise _out_of_time(backend, timeout_s, observed + len(ended.finished))
            if now >= quiet_until:
                hung = True
                break
            try:
                line = lines.get(timeout=min(deadline, quiet_until) - now)
            except queue.Empty:
                continue
            if line is None:  # its stdout closed: it ended
                break
            msg = _ours(line)
            if msg is None:
                continue
            quiet_until, allowed = time.monotonic() + case_timeout_s, case_timeout_s
            if "starting" in msg:
                ended.started = msg["starting"]
            else:
                ended.finished[msg["case"]["name"]] = msg["case"]
                ended.started, ended.last = None, msg["case"]["name"]
    finally:
        if child.poll() is None and (hung or time.monotonic() >= deadline):
            child.kill()
        child.wait()
        for reader in readers:
            reader.join(10)
    if hung:
        ended.death = f"no answer within {allowed:g} s, killed"
        return ended
    if all(name in ended.finished for name in names):
        return ended
    said = (last_words or [""])[-1].strip()
    if ended.started is None and not ended.finished and child.returncode == UNAVAILABLE:
        raise BackendUnavailable(said.removeprefix("error: ") or f"exit status {UNAVAILABLE}")
    if child.returncode < 0:  # a signal leaves no last words: its stderr's last line is an earlier case's chatter
        ended.death = _signal_name(-child.returncode)
    else:  # an exit with a status usually says why last (an uncaught exception's line, a library's error)
        ended.death, ended.said = f"exit {child.returncode}", f": {said}" if said else ""
    return ended


def _drain(stream, put, eof: bool = False) -> None:
    """Hand each line of ``stream`` to ``put`` (then None, if ``eof``), until it closes."""
    for line in stream:
        put(line.rstrip("\n"))
    if eof:
        put(None)
    stream.close()


def _out_of_time(backend: str, timeout_s: float, observed: int) -> BackendUnavailable:
    return BackendUnavailable(
        f"the conformance run on {backend} NIXL did not finish within {timeout_s:g} s "
        f"({observed} of {len(CASES)} cases observed)"
    )


def _ours(line: str) -> dict[str, Any] | None:
    """A line of the child's protocol, or None for anything else on its stdout (a library's output, or a line cut
    short by the child's death)."""
    if not line.startswith("{"):
        return None
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    if not isinstance(msg, dict):
        return None
    if isinstance(msg.get("starting"), str) and msg["starting"] in CASES:
        return msg
    case = msg.get("case")
    if isinstance(case, dict) and case.get("name") in CASES:
        return msg
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name in Python
        return f"signal {number}"
