"""Run the NIXL behaviour catalogue against a backend and name the profile it matches.

``python -m real_backends.probe --backend real --json`` is what ``epsim conform`` runs in a child process.  Cases that
may kill the process on the real library, or that need ``UCX_TLS=tcp`` set before UCX starts, each run in a process
of their own (``--case NAME --raw``); a death by signal is observed as the signal's name.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import traceback
from typing import Any

from fakes.conformance import CASES, matched_profile, observe
from fakes.conformance.catalogue import plain
from fakes.conformance import nixl_cases  # noqa: F401 - registers the cases
from fakes.nixl.profiles import PROFILES
from real_backends.rank import die_with_parent

CASE_TIMEOUT_S = 180

UNAVAILABLE = 3  # exit status when the chosen backend cannot be used here (missing library, no GPU)
# UCX transports for the asynchronous ("tcp") cases.  cuda_copy stays in the list: a CUDA-enabled UCX needs it to
# classify memory at registration, and without it registering even host memory fails with nixlBackendError
# (seen on an H200 host); on a CPU-only host UCX ignores it.
TCP_TLS = os.environ.get("EPSIM_UCX_TCP_TLS", "tcp,cuda_copy")


def make_backend(backend: str, profile: str = "dram", memory: str = "DRAM", transport: str = "cma"):
    if backend == "fake":
        from fakes.conformance.backend import FakeBackend

        return FakeBackend(profile=profile, memory=memory, transport=transport)
    if backend == "real":
        from .nixl_real import RealBackend

        return RealBackend(memory=memory)
    raise LookupError(f"backend {backend!r} not known; use fake or real")


def observe_case(name: str, backend: str, profile: str = "dram", memory: str = "DRAM") -> Any:
    """The observation of one case, in this process."""
    case = CASES[name]
    b = make_backend(backend, profile, memory, case.transport)
    try:
        return case.fn(b)
    finally:
        b.close()


def _observe_isolated(name: str, backend: str, profile: str, memory: str) -> Any:
    case = CASES[name]
    env = dict(os.environ)
    if case.transport == "tcp":
        env["UCX_TLS"] = TCP_TLS
    cmd = [
        sys.executable,
        "-m",
        "real_backends.probe",
        "--case",
        name,
        "--backend",
        backend,
        "--profile",
        profile,
        "--memory",
        memory.lower(),
        "--raw",
    ]
    try:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=CASE_TIMEOUT_S, preexec_fn=die_with_parent
        )
    except subprocess.TimeoutExpired:
        return f"timeout after {CASE_TIMEOUT_S} s"
    if done.returncode < 0:
        return signal.Signals(-done.returncode).name
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"error: exit {done.returncode}: {tail}"
    return json.loads(lines[-1])["observed"]


def run_case(name: str, backend: str = "fake", profile: str = "dram", memory: str = "DRAM") -> dict[str, Any]:
    """One case, judged against ``profile``: a dict with name, outcome (pass/fail/skip), observed, expected."""
    case = CASES[name]
    reason = skip_reason(case, backend, memory)
    if reason:
        return {
            "name": name,
            "outcome": "skip",
            "observed": None,
            "expected": case.on_hardware(profile),
            "reason": reason,
        }
    try:
        if backend == "real" and case.isolate:
            observed = _observe_isolated(name, backend, profile, memory)
        else:
            observed = observe(lambda: observe_case(name, backend, profile, memory))
    except Exception as exc:  # noqa: BLE001 - a broken case is a failed case, with its reason
        observed = f"error: {type(exc).__name__}: {exc}"
    return judge({"name": name, "observed": plain(observed)}, profile, hardware=backend == "real")


def skip_reason(case, backend: str, memory: str) -> str | None:
    if memory == "VRAM" and "host-memory" in case.needs:
        return "needs host memory; not run with --memory vram"
    if backend == "real" and "no-cuda-context" in case.needs:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return (
                "a CUDA context is live in this process: UCX classifies memory through CUDA and refuses "
                "degenerate ranges (seen on H200); run it through `epsim conform`, which starts fresh"
            )
    return None


def judge(result: dict[str, Any], profile: str, hardware: bool) -> dict[str, Any]:
    """Compare with what ``profile`` says of its hardware (a real backend) or of the fake (hardening included)."""
    case = CASES[result["name"]]
    expected = case.on_hardware(profile) if hardware else case.expected(profile)
    if result.get("outcome") == "skip":
        return {**result, "expected": expected}
    return {**result, "expected": expected, "outcome": "pass" if result["observed"] == expected else "fail"}


def run_catalogue(
    backend: str = "fake",
    profile: str | None = None,
    memory: str = "DRAM",
    names: list[str] | None = None,
    progress=None,
) -> dict[str, Any]:
    """Every case (or ``names``).  Without ``profile``, cases are judged against the profile they match (or, if
    none matches, the default for the memory kind: dram for host memory, cuda for VRAM)."""
    chosen = default_profile(profile, memory)
    make_backend(backend, chosen, memory).close()  # an unusable backend is one error, not a failure per case
    results = []
    for name in names or list(CASES):
        results.append(run_case(name, backend, chosen, memory))
        if progress:
            progress(results[-1])
    return summarise(results, backend, profile, memory)


def default_profile(profile: str | None, memory: str) -> str:
    return profile or ("cuda" if memory.upper() == "VRAM" else "dram")


def summarise(results: list[dict[str, Any]], backend: str, profile: str | None, memory: str) -> dict[str, Any]:
    """The catalogue's report from its cases' results (judged against ``default_profile``): without ``profile``,
    every case is judged again against the profile the observations match, if one does."""
    chosen = default_profile(profile, memory)
    observed = {r["name"]: r["observed"] for r in results if r["outcome"] != "skip"}
    matched = matched_profile(observed, hardware=backend == "real")
    if profile is None and matched is not None and matched != chosen:
        chosen = matched
        results = [judge(r, chosen, hardware=backend == "real") for r in results]
    return {"backend": backend, "profile": chosen, "memory": memory, "cases": results, "matched_profile": matched}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m real_backends.probe")
    parser.add_argument("--backend", choices=["fake", "real"], default="fake")
    parser.add_argument("--profile", choices=sorted(PROFILES), default=None)
    parser.add_argument("--memory", choices=["dram", "vram"], default="dram")
    parser.add_argument("--case", action="append", default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--raw", action="store_true", help="one case, its observation only (internal)")
    parser.add_argument(
        "--stream",
        action="store_true",
        help="a JSON line as each case starts and ends, no report (internal: epsim conform)",
    )
    args = parser.parse_args(argv)
    memory = args.memory.upper()
    if args.raw:
        name = args.case[0]
        value = observe(lambda: observe_case(name, args.backend, args.profile or "dram", memory))
        print(json.dumps({"observed": value}), flush=True)
        os._exit(0)  # skip interpreter teardown with agents alive: the observation is already out
    unknown = [c for c in args.case or [] if c not in CASES]
    if unknown:
        print(f"error: unknown case {unknown[0]!r}; run with --json to list them", file=sys.stderr)
        return 2
    from .nixl_real import NixlUnavailable

    if args.stream:
        return _stream(args.backend, args.profile, memory, args.case)
    try:
        report = run_catalogue(
            args.backend, args.profile, memory, args.case, progress=None if args.json else _print_line
        )
    except NixlUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return UNAVAILABLE
    except Exception as exc:  # noqa: BLE001
        print(f"error: {exc}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        print(f"matched profile: {report['matched_profile']}")
    failed = any(r["outcome"] == "fail" for r in report["cases"])
    sys.stdout.flush()
    os._exit(1 if failed else 0)


def _stream(backend: str, profile: str | None, memory: str, names: list[str] | None) -> int:
    """Each case's start and result as a line of its own, so a parent that sees this process die knows which
    case it died in and keeps every result before it (``sim.conform``)."""
    from .nixl_real import NixlUnavailable

    chosen = default_profile(profile, memory)
    try:
        make_backend(backend, chosen, memory).close()
    except NixlUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return UNAVAILABLE
    except Exception as exc:  # noqa: BLE001 - one line for the parent to show
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    # Every case allocates its buffers with torch: importing it here puts its seconds in the start-up, which has
    # a bound of its own (sim.conform), and not in whichever case comes first.
    import torch  # noqa: F401

    for name in names or list(CASES):
        print(json.dumps({"starting": name}), flush=True)
        print(json.dumps({"case": run_case(name, backend, chosen, memory)}), flush=True)
    os._exit(0)  # skip interpreter teardown with agents alive: every result is already out


def _print_line(r: dict[str, Any]) -> None:
    print(
        f"{r['outcome']:4}  {r['name']}"
        + ("" if r["outcome"] == "pass" else f"  observed={r.get('observed')!r} expected={r['expected']!r}"),
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
