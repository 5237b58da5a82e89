"""Shared fixtures: which NIXL a test runs against, and marker-driven skips that always say why."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest


def epsim(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The ``epsim`` command in a fresh interpreter, as a user runs it: (return code, stdout, stderr)."""
    return subprocess.run([sys.executable, "-m", "sim.cli", *args], capture_output=True, text=True, timeout=timeout)


def epsim_here(*args: str) -> subprocess.CompletedProcess:
    """The same command through the same entry point (``sim.cli.main``) in this interpreter: for input that must be
    refused before any work, where a fresh interpreter would cost seconds of imports per case."""
    import contextlib
    import io

    from sim import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(list(args))
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return subprocess.CompletedProcess(["epsim", *args], code, out.getvalue(), err.getvalue())


def epsim_loading(
    *args: str, watch: tuple[str, ...], timeout: float = 300
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """The ``epsim`` command in a fresh interpreter, and which of the modules ``watch`` it had imported when it
    ended (its output, less the last line of stdout, which the probe adds)."""
    probe = (
        "import json, sys\nfrom sim import cli\ntry:\n    cli.main(sys.argv[2:])\nexcept SystemExit:\n"
        "    pass\nprint(json.dumps(sorted(m for m in sys.argv[1].split(',') if m in sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, ",".join(watch), *args], capture_output=True, text=True, timeout=timeout
    )
    *out, loaded = done.stdout.splitlines()
    return subprocess.CompletedProcess(
        ["epsim", *args], done.returncode, "".join(f"{line}\n" for line in out), done.stderr
    ), json.loads(loaded)


def started_as(out) -> list[str]:
    """How each rank process of a real run written with ``--out out`` was started (``process.start`` records)."""
    import json
    from pathlib import Path

    lines = (Path(out) / "history.jsonl").read_text().splitlines()
    return [json.loads(line)["started_as"] for line in lines if '"process.start"' in line]


def sigint_at_default() -> None:
    """``preexec_fn`` of a child a test will ^C: SIGINT at its default, as at a terminal. A shell without job control
    starts background jobs (a suite run with ``&``) with SIGINT ignored, and Python keeps an ignored SIGINT ignored,
    so without this the child would shrug off the ^C the test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# On a small machine, real rank processes give NIXL's progress thread a 1 ms poll timeout instead of nixl._api's
# busy loop, a core spinning per agent (real_backends/nixl_real.py): on a 2-core machine that loop took a third of
# the real-backend tests' CPU (user and system time over four real runs: 116 s with it, 82 s without).  A host with
# a core per rank (a GPU host: the gated GPU job's evidence) keeps vLLM's own configuration, and so do one real
# scale-up (tests/real/test_real_runs.py) and, in the exhaustive run, the async-EPLB torchrun run
# (tests/real/test_torchrun.py) everywhere.
if (os.cpu_count() or 1) < 8:
    os.environ.setdefault("EPSIM_NIXL_PROGRESS_DELAY_US", "1000")

# Every history the suite makes (simulated runs, and real runs' judged ledgers, in this process and in the epsim
# commands it starts) checks each record against its kind in sim/events.py, and a run with one that is not its
# kind's is an internal error: the schema and docs/reference/history.md cannot drift from what is recorded.
os.environ.setdefault("EPSIM_CHECK_EVENTS", "1")

# CI sets this: there, the real NIXL is installed on purpose, so failing to import it is an error, not a skip.
REQUIRE_REAL_NIXL = os.environ.get("EPSIM_REQUIRE_REAL_NIXL") == "1"


def real_nixl_or_skip():
    """(api, bindings, package) of the real NIXL, or skip (fail under EPSIM_REQUIRE_REAL_NIXL=1) with the reason."""
    from real_backends.nixl_real import NixlUnavailable, import_real_nixl

    try:
        return import_real_nixl()
    except NixlUnavailable as exc:
        if REQUIRE_REAL_NIXL:
            pytest.fail(f"EPSIM_REQUIRE_REAL_NIXL=1 but {exc}")
        pytest.skip(str(exc))


@pytest.fixture(params=["fake", "real"])
def nixl_impl(request) -> str:
    """``fake`` or ``real``: the NIXL implementation a conformance test runs against."""
    if request.param == "real":
        real_nixl_or_skip()
    return request.param


def _cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible (gpu tests run in the gated GPU job, see docs/gpu-validation.md)"
    return None


SLOW = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow") + os.sep


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run the exhaustive tier (tests marked slow, and tests/slow/): every seed, "
        "parameter and matrix cell where the default run checks a sample",
    )


def pytest_collection_modifyitems(config, items) -> None:
    reason = None
    for item in items:
        if str(item.path).startswith(SLOW):  # the folder is the marker
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords:
            reason = reason or _cuda_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
    # The default run leaves the exhaustive tier out (deselected, and counted so in pytest's summary line); --slow
    # or a -m expression of the caller's own (`-m slow`) takes it in.
    if not config.getoption("--slow") and not config.option.markexpr:
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]


def pytest_unconfigure(config) -> None:
    # Communicators some tests leak on purpose (gc.never, broken strategies) are finalized at interpreter exit, where
    # the fake NIXL logs the calls it refuses; the tests have judged them already, as `epsim run` has (sim/cli.py).
    from sim import quiet

    quiet.for_good()


# CI sets this too: there the package index is reachable, so failing to fetch vLLM's released sources is an error.
REQUIRE_VLLM = os.environ.get("EPSIM_REQUIRE_VLLM") == "1"


@pytest.fixture(scope="session")
def released():
    """vLLM 0.33.0's sources (sim.vllm.source.released): fetched once into epsim's cache with ``pip download``;
    a skip where the index cannot be reached (a failure under EPSIM_REQUIRE_VLLM=1)."""
    from sim.errors import UnknownStrategy
    from sim.vllm import source

    try:
        return source.released()
    except UnknownStrategy as exc:
        if REQUIRE_VLLM:
            pytest.fail(f"EPSIM_REQUIRE_VLLM=1 but {exc}")
        pytest.skip(str(exc))
