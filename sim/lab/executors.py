"""Where a sweep's runs execute: worker processes on this machine, or a Ray cluster.

Both engines take :class:`~sim.lab.sweep.RunSpec` s and yield database rows in the order runs finish.  A run that takes
its worker process down (a segfault, ``os._exit``, the OOM killer) is a ``worker_crash`` row, one that runs past the
timeout is killed and is a ``timeout`` row, and the sweep goes on with a fresh worker in both cases.

The local engine keeps its own long-lived worker processes instead of a ``concurrent.futures`` pool, whose every
future fails once one worker dies (``loky`` likewise); ``pebble`` isolates a death but misses a worker that exits
with status 0 and has no start-up limit, for the same throughput (docs/sweeps.md has the measurements).  Workers
are forked by multiprocessing's fork server, which imports the simulator once (torch: seconds of CPU) and has run
nothing, started no thread of its own and made no greenlet: every worker, the first ones and those that replace a
crashed or timed-out one, starts with the simulator imported and nothing else of the parent's.  Where there is no
fork server (not a POSIX system), workers are spawned and each imports the simulator itself.  A worker whose parent
dies sees its pipe close and exits.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import time
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Iterable, Iterator

from ..errors import BackendUnavailable, ScenarioError
from .sweep import RunSpec, execute, failed_row


def _worker_main(conn) -> None:
    import atexit

    from .. import quiet

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    atexit.register(quiet.for_good)  # what leaked runs' finalizers log at exit is in their histories
    from .. import run  # noqa: F401 - the simulator's imports (torch: seconds), before any run's clock starts

    while True:
        try:
            spec = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if spec is None:
            return
        try:
            conn.send(BEGIN)  # the run's --timeout counts from here
        except (BrokenPipeError, OSError):
            return
        row = execute(spec)
        try:
            conn.send(row)
        except (BrokenPipeError, OSError):
            return  # the parent died while this run went on


BEGIN = "begin"  # what a worker says when a run starts (its imports done), before the run's row
START_LIMIT_S = 300.0  # a worker that has not begun a run this long after getting it is taken for dead


def _deadline(started: float, begun: bool, timeout: float | None) -> float:
    """When a run is out of time: ``timeout`` after it began, or the start-up limit until then (a fresh worker, local
    or Ray, imports the simulator first, seconds that are not the run's)."""
    if not begun:
        return started + START_LIMIT_S
    return started + timeout if timeout is not None else float("inf")


class _Worker:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="epsim-sweep-worker")
        self.proc.start()
        child.close()
        self.spec: RunSpec | None = None
        self.started = 0.0  # when the run was handed over, then when the worker began it
        self.begun = False

    def give(self, spec: RunSpec) -> None:
        self.spec, self.started, self.begun = spec, time.monotonic(), False
        self.conn.send(spec)

    def deadline(self, timeout: float | None) -> float:
        return _deadline(self.started, self.begun, timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


# What the fork server imports before it forks a worker: the simulator, as a worker's first run would.
PRELOAD = ["sim.lab.executors", "sim.run"]


def _context():
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # One fork server per process, started with the first worker and kept for the process's later sweeps (a test
    # session's, an interactive session's): its environment and sys.path are those of that moment.
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class LocalEngine:
    name = "local"

    def __init__(self, workers: int | None = None, timeout: float | None = None) -> None:
        self.workers = max(1, workers or os.cpu_count() or 1)
        self.timeout = timeout
        self._ctx = _context()

    def start(self) -> None:
        """Nothing to connect to: workers start with the first runs."""

    def map(self, specs: Iterable[RunSpec]) -> Iterator[dict[str, Any]]:
        queue = deque(specs)
        pool = [_Worker(self._ctx) for _ in range(min(self.workers, len(queue)))]
        try:
            for w in pool:
                if queue:
                    w.give(queue.popleft())
            while any(w.spec is not None for w in pool):
                yield from self._collect(pool, queue)
        finally:
            for w in pool:
                w.kill()

    def _collect(self, pool: list[_Worker], queue: deque) -> Iterator[dict[str, Any]]:
        busy = [w for w in pool if w.spec is not None]
        now = time.monotonic()
        first = min(w.deadline(self.timeout) for w in busy)
        wait_s = None if first == float("inf") else max(0.0, first - now)
        ready = set(wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout=wait_s))
        for i, w in enumerate(pool):
            spec = w.spec
            if spec is None:
                continue
            row = None
            if w.conn in ready:
                try:
                    row = w.conn.recv()
                except (EOFError, OSError):
                    row = None
                if row == BEGIN:
                    w.started, w.begun, row = time.monotonic(), True, None
                    continue
                if row is None:  # the pipe closed under us: the process died mid-run
                    w.proc.join(5)
                    row = failed_row(spec, "worker_crash", _death(w.proc.exitcode), time.monotonic() - w.started)
                    pool[i] = w = self._replace(w)
            elif w.proc.sentinel in ready:
                w.proc.join(5)
                row = failed_row(spec, "worker_crash", _death(w.proc.exitcode), time.monotonic() - w.started)
                pool[i] = w = self._replace(w)
            elif time.monotonic() >= w.deadline(self.timeout):
                elapsed = time.monotonic() - w.started
                if w.begun:
                    row = failed_row(spec, "timeout", f"killed after {self.timeout:g} s", elapsed)
                else:
                    row = failed_row(
                        spec,
                        "worker_crash",
                        f"worker process did not begin the run within {START_LIMIT_S:g} s",
                        elapsed,
                    )
                pool[i] = w = self._replace(w)
            if row is None:
                continue
            w.spec = None
            if queue:
                w.give(queue.popleft())
            yield row

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        return _Worker(self._ctx)


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"worker process killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"worker process killed by signal {-exitcode}"
    return f"worker process exited with status {exitcode}"


class RayEngine:
    """The same runs as Ray tasks: ``address`` None starts a local Ray; "auto" or ``ray://...`` joins a cluster."""

    name = "ray"

    def __init__(self, workers: int | None = None, timeout: float | None = None, address: str | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise BackendUnavailable("--engine ray needs Ray: pip install 'epsim[ray]'") from None
        self.ray = ray
        self.timeout = timeout
        self.address = address
        self.workers = workers

    def start(self) -> None:
        """Start or join Ray; a sweep calls this before it opens its database, so an address that cannot be joined
        leaves nothing behind."""
        ray = self.ray
        if ray.is_initialized():
            return
        if self.address:
            _check_reachable(self.address)
            try:
                ray.init(address=self.address, log_to_driver=False, logging_level=logging.ERROR)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise BackendUnavailable(
                    f"--ray-address {self.address}: cannot join that Ray cluster "
                    f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
                ) from None
        else:
            # Ray's own INFO and WARNING lines at start-up ("Started a local Ray instance", its token note) would
            # land between epsim's: only its errors are shown.
            ray.init(
                num_cpus=self.workers or os.cpu_count() or 1,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.ERROR,
            )

    def map(self, specs: Iterable[RunSpec]) -> Iterator[dict[str, Any]]:
        ray = self.ray
        self.start()
        # A generator task: it says BEGIN once the worker has the simulator imported, then gives the row, so that
        # --timeout counts from the moment the run begins, as with local workers (a Ray worker started for the
        # task, or restarted after a crash, imports torch first: seconds that are not the run's).
        task = ray.remote(num_cpus=1, max_retries=0, num_returns="streaming")(_ray_execute)
        queue = deque(specs)
        limit = self.workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        running: dict[Any, _RayRun] = {}
        while queue or running:
            while queue and len(running) < limit:
                spec = queue.popleft()
                running[task.remote(spec)] = _RayRun(spec, time.monotonic())
            first = min(run.deadline(self.timeout) for run in running.values())
            wait_s = None if first == float("inf") else max(0.0, first - time.monotonic())
            done, _ = ray.wait(list(running), num_returns=1, timeout=wait_s)
            for gen in done:
                run = running[gen]
                row = self._next(gen, run)
                if row == BEGIN:  # a copy of it, through the object store
                    run.started, run.begun = time.monotonic(), True
                    continue
                del running[gen]
                yield row
            for gen, run in list(running.items()):
                if time.monotonic() >= run.deadline(self.timeout):
                    ray.cancel(gen, force=True)
                    del running[gen]
                    elapsed = time.monotonic() - run.started
                    if run.begun:
                        yield failed_row(run.spec, "timeout", f"cancelled after {self.timeout:g} s", elapsed)
                    else:
                        yield failed_row(
                            run.spec,
                            "worker_crash",
                            f"Ray worker did not begin the run within {START_LIMIT_S:g} s",
                            elapsed,
                        )

    def _next(self, gen, run: "_RayRun") -> Any:
        """What the task gave next: BEGIN, its row, or a failed row for a worker that died or a task that failed."""
        exceptions = self.ray.exceptions
        elapsed = time.monotonic() - run.started
        try:
            return self.ray.get(next(gen))
        except StopIteration:
            return failed_row(run.spec, "error", "Ray: the task ended without a row", elapsed)
        except (exceptions.WorkerCrashedError, exceptions.NodeDiedError, exceptions.ActorDiedError) as exc:
            return failed_row(run.spec, "worker_crash", f"Ray worker died: {type(exc).__name__}", elapsed)
        except exceptions.RayError as exc:
            return failed_row(run.spec, "error", f"Ray: {type(exc).__name__}: {str(exc).splitlines()[0]}", elapsed)


class _RayRun:
    """A run handed to Ray: when it was submitted, then when the worker began it (the clock of its --timeout)."""

    def __init__(self, spec: RunSpec, submitted: float) -> None:
        self.spec, self.started, self.begun = spec, submitted, False

    def deadline(self, timeout: float | None) -> float:
        return _deadline(self.started, self.begun, timeout)


def _ray_execute(spec: RunSpec) -> Iterator[Any]:
    """The Ray task: the simulator's imports, BEGIN, then the run's row."""
    from .. import run  # noqa: F401 - the simulator's imports (torch: seconds), before the run's clock starts

    yield BEGIN
    yield execute(spec)


REACH_TIMEOUT_S = 10.0


def _check_reachable(address: str) -> None:
    """Refuse a ``HOST:PORT`` (or ``ray://HOST:PORT``) nothing listens on, in one line: Ray itself retries such an
    address for minutes (a refused port on this machine, for one).  ``auto`` and other forms are left to Ray."""
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
        raise BackendUnavailable(f"--ray-address {address}: cannot reach {hostport} ({why})") from None


def make(name: str, workers: int | None, timeout: float | None, address: str | None = None):
    if name == "local":
        if address is not None:
            raise ScenarioError("--ray-address is for --engine ray; the local engine runs on this machine")
        return LocalEngine(workers, timeout)
    if name == "ray":
        return RayEngine(workers, timeout, address)
    raise ScenarioError(f"--engine {name!r}: use local or ray")
