"""Runs the DeepEP catalogue (``fakes/conformance/deep_ep_cases.py``) against the fake or a real DeepEP build.

The fake runs each case's ranks as simulated threads of one kernel (the simulated clock times the waits). A real
DeepEP runs each case in fresh processes, one per rank, on the visible GPUs in turn (two ranks share GPU 0 on a
one-GPU host, as the intranode kernels allow), over a gloo group as vLLM's managers build their buffers on the EP
group's CPU group. A case whose ranks do not all answer within the time limit is observed as ``"hang"`` on the ranks
that did not answer, and its processes are killed: a wedged buffer never stops the catalogue.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

from fakes.conformance.deep_ep_cases import CASES, Ctx, judge

DEFAULT_MODULE = "deep_ep"
CASE_TIMEOUT_S = 90.0  # a case's ranks start (torch, a CUDA context, gloo) and wait at most seconds in it


def run_case(name: str, impl: str, module: str = DEFAULT_MODULE, timeout_s: float = CASE_TIMEOUT_S) -> dict:
    """One case on ``fake`` or ``real``, judged."""
    observed = _run_fake(name) if impl == "fake" else _run_real(name, module, timeout_s)
    return judge(name, observed)


def run(
    impl: str,
    module: str = DEFAULT_MODULE,
    names: list[str] | None = None,
    on_case: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Every case (or ``names``) on one side: a report in the shape ``epsim conform`` prints; ``on_case`` hears each
    judged case as it ends."""
    started = time.monotonic()
    cases = []
    for name in names or list(CASES):
        cases.append(run_case(name, impl, module))
        if on_case is not None:
            on_case(cases[-1])
    return {
        "library": "deep_ep",
        "backend": impl,
        "module": module if impl == "real" else "fakes.deep_ep",
        "cases": cases,
        "seconds": round(time.monotonic() - started, 1),
    }


def unavailable(module: str = DEFAULT_MODULE) -> str | None:
    """Why a real DeepEP cannot run here (None if it can): no build importable, or no GPU."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "a real DeepEP needs a CUDA GPU; none is visible"
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"no DeepEP build importable as {module!r} ({exc}); docs/gpu-validation.md says how to build one"
    return None


def _failure(exc: BaseException) -> str:
    return f"raised {type(exc).__name__}: {exc}"


# -- the fake: simulated ranks --------------------------------------------------------------------------------------
@contextlib.contextmanager
def _python_stdout() -> Iterator[list[str]]:
    """What the fake prints (its console lines go through ``sys.stdout``)."""
    lines: list[str] = []
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield lines
    lines.extend(buffer.getvalue().splitlines())


def _run_fake(name: str) -> list:
    from fakes import deep_ep
    from sim.ranks import SimulatedRanks

    c = CASES[name]
    ranks = SimulatedRanks(c.ranks)
    kernel = ranks.kernel

    def on_rank(group: Any) -> Any:
        def start_thread(fn: Callable[[], None]) -> Callable[[], None]:
            th = kernel.spawn(f"rank{group.rank()}-thread", fn, pid=group.rank())
            return lambda: kernel.wait(th.done, f"join {th.name}")

        return c.fn(
            Ctx(
                deep_ep.Buffer,
                group,
                group.rank(),
                c.ranks,
                "cpu",
                lambda s: kernel.sleep(s, "a late rank"),
                kernel.now,
                _python_stdout,
                start_thread,
            )
        )

    with deep_ep.installed():
        observed = ranks.run(on_rank)
    # an unexpected raise is the observation
    return [_failure(o) if isinstance(o, BaseException) else o for o in observed]


# -- a real DeepEP: one process per rank ---------------------------------------------------------------------------
@contextlib.contextmanager
def _fd_stdout() -> Iterator[list[str]]:
    """What the process writes to file descriptor 1 (DeepEP's C++ ``printf`` goes there, not through Python)."""
    lines: list[str] = []
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield lines
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().decode(errors="replace").splitlines())


def _real_rank(name: str, rank: int, n: int, port: int, module: str, conn) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
        lib = importlib.import_module(module)
        ctx = Ctx(lib.Buffer, dist.group.WORLD, rank, n, "cuda", time.sleep, time.monotonic, _fd_stdout, _thread)
        observed = CASES[name].fn(ctx)
        torch.cuda.synchronize()
    except BaseException as exc:  # noqa: BLE001 - an unexpected raise is the observation
        observed = _failure(exc)
    conn.send(observed)
    conn.close()
    # No interpreter teardown: a buffer a case leaked on purpose must not turn the exit into another observation.
    os._exit(0)


def _thread(fn: Callable[[], None]) -> Callable[[], None]:
    th = threading.Thread(target=fn, daemon=True)
    th.start()
    return th.join


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_real(name: str, module: str, timeout_s: float) -> list:
    c = CASES[name]
    ctx = mp.get_context("spawn")
    port = _free_port()
    members = []
    for rank in range(c.ranks):
        mine, theirs = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_real_rank, args=(name, rank, c.ranks, port, module, theirs), daemon=True)
        proc.start()
        theirs.close()
        members.append((proc, mine))
    observed: list = []
    deadline = time.monotonic() + timeout_s
    try:
        for proc, mine in members:
            try:
                got = mine.recv() if mine.poll(max(0.0, deadline - time.monotonic())) else "hang"
            except EOFError:
                proc.join(5)
                got = f"died (exit code {proc.exitcode})"
            observed.append(got)
    finally:
        for proc, _ in members:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return observed
