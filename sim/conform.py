"""``epsim conform``: the NIXL behaviour catalogue against one backend, run in a child process.

The child is ``python -m real_backends.probe``: a crash of the real library (some 1.5.1 misuse segfaults) cannot
take the CLI down with it, and the real NIXL's global state never leaks into the caller.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from fakes.nixl.profiles import PROFILES

from real_backends.probe import UNAVAILABLE
from real_backends.rank import die_with_parent

from .errors import BackendUnavailable, UnknownName

BACKENDS = ("fake", "real")
MEMORIES = ("dram", "vram")


def validate(backend: str, profile: str | None, memory: str) -> None:
    if backend not in BACKENDS:
        raise UnknownName(f"backend {backend!r} not known; use one of: {', '.join(BACKENDS)}")
    if profile is not None and profile not in PROFILES:
        raise UnknownName(f"profile {profile!r} not known; known: {', '.join(PROFILES)}")
    if memory not in MEMORIES:
        raise UnknownName(f"memory {memory!r} not known; use one of: {', '.join(MEMORIES)}")


def run(backend: str, profile: str | None, memory: str, timeout_s: float = 1800) -> dict[str, Any]:
    validate(backend, profile, memory)
    cmd = [sys.executable, "-m", "real_backends.probe", "--backend", backend, "--memory", memory, "--json"]
    if profile:
        cmd += ["--profile", profile]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, preexec_fn=die_with_parent)
    except subprocess.TimeoutExpired:
        raise BackendUnavailable(f"the conformance run on {backend} NIXL did not finish within {timeout_s:g} s") \
            from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        if done.returncode == UNAVAILABLE:
            raise BackendUnavailable(tail.removeprefix("error: "))
        raise BackendUnavailable(f"the conformance run on {backend} NIXL produced no result: {tail}")
    return json.loads(lines[-1])
