"""The simulation kernel: a SimPy environment in which every simulated thread is a greenlet.

Code under test is ordinary synchronous Python.  When it blocks (a collective, a transfer poll, ``time.sleep``) it
calls :meth:`Kernel.wait` with a SimPy event; that switches to the kernel's greenlet (the *hub*, which runs the SimPy
loop) and comes back with the event's value, or its exception, once the event fires in simulated time.  Nothing
here reads the wall clock, and events scheduled for the same instant run in an order drawn from a seeded stream, so
one seed gives one history, and different seeds explore different interleavings.

Only three verbs matter: :meth:`spawn` a thread, :meth:`wait` in it, :meth:`run` the world.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import operator
import random
import sys
import time
import uuid
from heapq import heappush
from typing import Any, Callable, Iterator

import simpy
from greenlet import GreenletExit, greenlet

from .errors import exception_line, no_addresses
from .rng import Streams, Tape
from .trace import History


# The kernel pushes onto SimPy's event heap itself (seeded tie-breaks) and reads its clock attribute: private
# attributes of SimPy 4.1 (tested: 4.1.2; pyproject pins the 4.1 series).  Another SimPy is refused in one line
# rather than trusted to keep them.
SIMPY_TESTED = "4.1"
_simpy_checked = False


def _check_simpy() -> None:
    env = simpy.Environment()
    version = getattr(simpy, "__version__", "unknown")
    if not (
        isinstance(getattr(env, "_queue", None), list)
        and isinstance(getattr(env, "_now", None), (int, float))
        and version.startswith(SIMPY_TESTED + ".")
    ):
        from .errors import BackendUnavailable

        raise BackendUnavailable(
            f"simpy {version} is installed; epsim's kernel drives SimPy {SIMPY_TESTED}'s event "
            f"heap: pip install 'simpy>={SIMPY_TESTED},<4.2'"
        )


class _Env(simpy.Environment):
    """SimPy with seeded tie-breaks: same-time, same-priority events run in an order drawn from a stream."""

    def __init__(self, tiebreak: Callable[[], float] | None) -> None:
        super().__init__()
        self._tiebreak = tiebreak
        self._seq = itertools.count()

    def schedule(self, event, priority=simpy.core.NORMAL, delay=0) -> None:
        key = (self._tiebreak() if self._tiebreak else 0.0, next(self._seq))
        heappush(self._queue, (self._now + delay, priority, key, event))  # type: ignore[misc]  # SimPy's heap


class SimThread:
    """One simulated thread of one simulated process (rank)."""

    def __init__(
        self, kernel: "Kernel", name: str, pid: int, fn: Callable, args: tuple, kwargs: dict, daemon: bool
    ) -> None:
        self.kernel, self.name, self.pid, self.daemon = kernel, name, pid, daemon
        self._fn, self._args, self._kwargs = fn, args, kwargs
        self.glet: greenlet | None = None
        self.state = "new"  # new, running, blocked, done, failed, killed
        self.blocked_on = ""
        self.result: Any = None
        self.exception: BaseException | None = None
        self.done = kernel.env.event()
        self.resume: Callable[[Any], None] | None = None  # set by the kernel when it schedules the first run

    def __repr__(self) -> str:
        where = f" on {self.blocked_on}" if self.state == "blocked" and self.blocked_on else ""
        return f"<SimThread {self.name!r} pid={self.pid} {self.state}{where}>"

    @property
    def alive(self) -> bool:
        return self.state in ("new", "running", "blocked")


class BlockingOutsideThread(RuntimeError):
    pass


class Kernel:
    """A world of simulated threads on a simulated clock."""

    def __init__(
        self, seed: int = 0, *, tape: Tape | None = None, tiebreak: bool = True, stop_on_crash: bool = True
    ) -> None:
        global _simpy_checked
        if not _simpy_checked:
            _check_simpy()
            _simpy_checked = True
        self.seed = seed
        self.streams = Streams(seed, tape)
        sched = self.streams.get("schedule", record=False)
        # The generator's own method: tie-breaks are not recorded, and one draw per scheduled event is the
        # kernel's hottest call.
        self.env = _Env(sched.raw().random if tiebreak else None)
        # The clock and the current thread are read several times per NIXL call of every rank (a million times an
        # hour at DeepSeek scale): C-level accessors instead of a Python method and a property each.
        self.now = functools.partial(operator.attrgetter("_now"), self.env)  # type: ignore[method-assign]
        self.current = functools.partial(operator.attrgetter("_current"), self)  # type: ignore[method-assign]
        self.history = History(self.now)
        self.threads: list[SimThread] = []
        self.crashes: list[tuple[SimThread, BaseException]] = []
        self.unraisable: list[tuple[str, BaseException]] = []
        self._random_state: Any = None  # the random module's state between run()s of this world
        self.stop_on_crash = stop_on_crash
        self._current: SimThread | None = None
        self._hub: greenlet | None = None
        self._halt = self.env.event()
        self._zombies: list[SimThread] = []  # killed threads: kept referenced so their frames never unwind
        # pid -> the thread waiting in a native call that holds that process's GIL (DeepEP's destroy barrier, its
        # intranode dispatch's receive wait): no other thread of the process runs until it returns.
        self._gil: dict[int, SimThread] = {}
        self._parked: dict[int, list[tuple[SimThread, Any]]] = {}  # pid -> resumes deferred until the GIL is free

    # -- clock ----------------------------------------------------------------------------------------------
    def now(self) -> float:  # replaced per instance by a C-level accessor of the same value
        return self.env.now

    # -- threads ----------------------------------------------------------------------------------------------
    def spawn(
        self, name: str, fn: Callable, *args: Any, pid: int = 0, daemon: bool = False, **kwargs: Any
    ) -> SimThread:
        th = SimThread(self, name, pid, fn, args, kwargs, daemon)
        self.threads.append(th)
        self._start(th)
        self.history.record("thread.start", thread=name, pid=pid)
        return th

    def current(self) -> SimThread | None:  # replaced per instance, as now()
        return self._current

    def _start(self, th: SimThread) -> None:
        """Schedule the thread's first run, as SimPy schedules a new process (an urgent event, now)."""
        ev = simpy.events.Event(self.env)
        ev._ok, ev._value = True, None
        th.resume = lambda event: self._step(th, event)  # made once: the callback of every wait of the thread
        ev.callbacks.append(lambda _e: self._step(th, None))
        self.env.schedule(ev, simpy.core.URGENT)

    def _step(self, th: SimThread, event: Any) -> None:  # a simpy.events.Event; None at the first run
        """Resume ``th`` with what ``event`` gave (its first run when None) and let it run to its next wait.

        Threads are driven by event callbacks, not by a SimPy process each: a wait registers this method on the
        event it blocks on, and the event firing resumes the greenlet.  The schedule is the one a process-driven
        kernel makes (same events, same order, same tie-break draws), so histories do not depend on it."""
        if self._gil:
            holder = self._gil.get(th.pid)
            if holder is not None and holder is not th:
                # Its wait is over, but the interpreter lock is not free: it runs when the holder's call returns.
                th.blocked_on = f"the GIL ({holder.name} holds it in {holder.blocked_on})"
                self._parked.setdefault(th.pid, []).append((th, event))
                return
        while True:
            if th.state == "killed":  # never runs another line; kept in _zombies so its frames never unwind
                self._ended()
                return
            self._current = th
            th.state = "running"
            glet = th.glet
            try:
                if glet is None:  # the first run starts the function
                    glet = th.glet = greenlet(run=lambda: th._fn(*th._args, **th._kwargs), parent=self._hub)
                    request = glet.switch()
                elif event._ok:
                    request = glet.switch(event._value)
                else:
                    event._defused = True  # delivered into the thread: it decides what the failure means
                    request = glet.throw(event._value)
            except KeyboardInterrupt:  # Ctrl-C reached epsim's own process while this thread ran: not a finding
                self._current = None
                raise
            except BaseException as exc:  # noqa: BLE001 - the thread died with it: that is a finding
                self._current = None
                self._thread_failed(th, exc)
                self._ended()
                return
            self._current = None
            if glet.dead:
                th.state, th.result = "done", request
                th.done.succeed(request)
                self.history.record("thread.end", thread=th.name, pid=th.pid)
                self._ended()
                return
            if th.state == "killed":  # it killed its own process: the switch below never came back
                return
            th.state = "blocked"
            if request.callbacks is not None:
                request.callbacks.append(th.resume)
                return
            event = request  # already processed: resume at once, as a SimPy process does

    def _ended(self) -> None:
        # A finished SimPy process is itself an event scheduled at its end; keeping that (empty) event keeps the
        # tie-break stream, and so every later same-time ordering, what it was when threads were processes.
        ev = simpy.events.Event(self.env)
        ev._ok, ev._value = True, None
        self.env.schedule(ev)

    def _thread_failed(self, th: SimThread, exc: BaseException) -> None:
        th.state, th.exception = "failed", exc
        th.done.succeed(None)
        self.crashes.append((th, exc))
        self.history.record("thread.crash", thread=th.name, pid=th.pid, error=exception_line(exc))
        if self.stop_on_crash:
            self.halt()

    def wait(self, event: simpy.events.Event, what: str = "", *, holds_gil: bool = False) -> Any:
        """Block the calling simulated thread until ``event`` fires; its value, or its exception raised here.

        ``holds_gil``: the wait is a native call that keeps its process's GIL (a pybind function without a GIL
        release, spinning or synchronizing the device): the process's other threads stay where they are until it
        returns, however long it waits."""
        th = self._current
        if th is None or self._hub is None:
            raise BlockingOutsideThread(f"blocking call ({what or 'wait'}) outside a simulated thread")
        th.blocked_on = what  # read only while the thread is blocked; the next wait overwrites it
        if not holds_gil:
            return self._hub.switch(event)
        self._gil[th.pid] = th
        try:
            return self._hub.switch(event)
        finally:
            self._release_gil(th.pid)

    def _release_gil(self, pid: int) -> None:
        """The holder's call returned: the threads whose waits ended meanwhile run, in the order they ended."""
        self._gil.pop(pid, None)
        for th, event in self._parked.pop(pid, ()):
            ev = simpy.events.Event(self.env)
            ev._ok, ev._value = True, None
            ev.callbacks.append(functools.partial(self._resume_parked, th, event))
            self.env.schedule(ev, simpy.core.URGENT)

    def _resume_parked(self, th: SimThread, event: Any, _ev: Any) -> None:
        self._step(th, event)

    def sleep(self, seconds: float, what: str = "sleep") -> None:
        th = self._current
        if th is None or self._hub is None:
            raise BlockingOutsideThread(f"blocking call ({what}) outside a simulated thread")
        th.blocked_on = what
        self._hub.switch(simpy.events.Timeout(self.env, seconds if seconds > 0.0 else 0.0))

    def wait_for(self, event: simpy.events.Event, timeout: float, what: str = "") -> tuple[bool, Any]:
        """(True, value) if ``event`` fired within ``timeout`` simulated seconds, else (False, None)."""
        if event.triggered:
            return True, event.value
        timer = self.env.timeout(timeout)
        self.wait(self.env.any_of([event, timer]), what)
        return (True, event.value) if event.triggered else (False, None)

    def kill_process(self, pid: int) -> list[SimThread]:
        """SIGKILL for simulated process ``pid``: its threads stop where they are and never run another line."""
        killed = []
        for th in self.threads:
            if th.pid == pid and th.alive:
                th.state = "killed"
                th.done.succeed(None)
                self._zombies.append(th)
                killed.append(th)
        self._gil.pop(pid, None)  # a killed process holds nothing; its parked threads never run
        self._parked.pop(pid, None)
        self.history.record("process.kill", pid=pid, threads=[t.name for t in killed])
        caller = self._current
        if caller is not None and caller in killed and self._hub is not None:
            # SIGKILL of its own process: the calling thread runs no further line either.  It parks on an event
            # that never fires, and _step leaves it parked.
            self._hub.switch(self.env.event())
        return killed

    def halt(self) -> None:
        if not self._halt.triggered:
            self._halt.succeed()

    # -- running ----------------------------------------------------------------------------------------------
    def run(self, until: float | None = None) -> None:
        """Run until ``until`` (simulated seconds), a halt, or nothing is left to happen."""
        self._hub = greenlet.getcurrent()
        halt_at = None
        if until is not None:
            halt_at = self.env.timeout(max(0.0, until - self.env.now))
            halt_at.callbacks.append(self._halt_now)
        try:
            with self.deterministic():
                try:
                    self.env.run(until=self._halt)
                except RuntimeError as exc:  # the schedule ran dry before a halt: everything finished or is stuck
                    if "No scheduled events left" not in str(exc):
                        raise
        finally:
            if halt_at is not None and halt_at.callbacks is not None:
                # This run ended before ``until`` (a crash, a halt, an interrupt): its timer stays scheduled, as
                # SimPy cannot take an event back, but must not halt a later run() of the same world.
                halt_at.callbacks.remove(self._halt_now)
            self._halt = self.env.event()  # a later run() continues the same world

    def _halt_now(self, _event: Any) -> None:
        self.halt()

    def blocked(self) -> list[SimThread]:
        return [t for t in self.threads if t.state == "blocked"]

    def close(self) -> None:
        """Drop every thread.  Killed and stuck greenlets unwind here, after the verdict, with tracing closed."""
        self.history.closed = True
        for th in self.threads:
            if th.glet is not None and not th.glet.dead:
                try:
                    th.glet.throw(GreenletExit)
                except BaseException:  # noqa: BLE001 - unwinding a dead world
                    pass
        self.threads.clear()
        self._zombies.clear()

    # -- determinism ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def deterministic(self) -> Iterator[None]:
        """While the world runs: no automatic garbage collection, simulated time for code in simulated threads
        (``time.sleep``, ``monotonic``, ``perf_counter``, ``time`` and their ``_ns`` forms), seeded UUIDs, a seeded
        ``random`` module, and finalizer exceptions recorded instead of printed.  Left to the machine: ``os.urandom``
        and ``secrets``, ``uuid.uuid1``, ``datetime.now`` and numpy's or torch's global generators; code under test
        that draws from them makes its run differ between processes (``--check-determinism`` shows it)."""
        kernel = self
        real = {
            name: getattr(time, name)
            for name in ("sleep", "monotonic", "time", "perf_counter", "monotonic_ns", "time_ns", "perf_counter_ns")
        }
        real_uuid4 = uuid.uuid4
        uuids = self.streams.get("uuid")
        real_hook = sys.unraisablehook
        was_enabled = gc.isenabled()

        def sim_sleep(seconds: float) -> None:
            if kernel._current is not None:
                kernel.sleep(seconds, "time.sleep")
            else:
                real["sleep"](seconds)

        def clock(name: str, base: float) -> Callable[[], float]:
            def now() -> float:
                return base + kernel.env.now if kernel._current is not None else real[name]()

            return now

        def clock_ns(name: str, base: float) -> Callable[[], int]:
            def now() -> int:
                return round((base + kernel.env.now) * 1e9) if kernel._current is not None else real[name]()

            return now

        def unraisable(info) -> None:
            # A finalizer's name; a weakref.finalize or a partial has none, and its repr holds an address.
            where = getattr(info.object, "__qualname__", None) or no_addresses(repr(info.object))
            # Kept without tracebacks: a traceback's frames hold the finalizer's locals (self, its agent), which
            # Python's own hook lets go once it has printed them; keeping them here made a leak of a clean exit.
            exc, seen = info.exc_value, set()
            while exc is not None and id(exc) not in seen:
                seen.add(id(exc))
                exc.__traceback__ = None
                exc = exc.__cause__ or exc.__context__
            kernel.unraisable.append((str(where), info.exc_value))
            kernel.history.record("finalizer.error", where=str(where), error=exception_line(info.exc_value))

        gc.disable()
        time.sleep = sim_sleep  # type: ignore[assignment]  # takes what time.sleep takes
        time.monotonic = clock("monotonic", 1000.0)
        time.perf_counter = clock("perf_counter", 1000.0)
        time.time = clock("time", 1.7e9)
        time.monotonic_ns = clock_ns("monotonic_ns", 1000.0)
        time.perf_counter_ns = clock_ns("perf_counter_ns", 1000.0)
        time.time_ns = clock_ns("time_ns", 1.7e9)
        uuid.uuid4 = lambda: uuid.UUID(int=uuids.getrandbits(128), version=4)
        sys.unraisablehook = unraisable
        # The random module: seeded from the run's seed on the first run(), carried over to a later one, and the
        # caller's state put back after.
        outside = random.getstate()
        if self._random_state is None:
            random.seed(self.streams.get("random", record=False).raw().getrandbits(64))
        else:
            random.setstate(self._random_state)
        try:
            yield
        finally:
            self._random_state = random.getstate()
            random.setstate(outside)
            for name, fn in real.items():
                setattr(time, name, fn)
            uuid.uuid4 = real_uuid4
            sys.unraisablehook = real_hook
            if was_enabled:
                gc.enable()
