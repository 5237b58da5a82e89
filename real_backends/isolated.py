"""Programs of library calls played in a child process that reports every step as it finishes.

Real NIXL 1.5.1 can kill its process: some misuse always does (a released request posted), and some sequences
only sometimes, by a race inside the library (a differential-test program crashed a test worker in ``transfer()``
once in thousands of runs and never again on the same kind of program). A crash inside a pytest-xdist worker loses
the worker and can leave the whole session waiting; in a child, it is an observation: the steps that finished, and
how the child died.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import signal
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from real_backends.rank import die_with_parent


@dataclass
class Played:
    """What a child reported of one program: every finished step's observation, and ``died`` (the signal's name,
    ``exit N`` or ``timeout``) if it did not get to the end."""

    steps: list[Any] = field(default_factory=list)
    died: str | None = None


class ChildPlayer:
    """Plays programs through ``target`` (``"module:function"``, called in the child as ``function(program,
    report)``, where ``report(observation)`` sends one step's observation) in a spawned child process, one program
    at a time; a child that died is replaced before the next program."""

    def __init__(self, target: str, step_timeout_s: float = 120.0) -> None:
        self.target, self.step_timeout_s = target, step_timeout_s
        self._proc: Any = None
        self._conn: Any = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")  # a fork would copy this process's threads' locks (NIXL's, pytest's) mid-use
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(self.target, child), daemon=True)
        self._proc.start()
        child.close()

    def play(self, program: Any) -> Played:
        if self._proc is None or not self._proc.is_alive():
            self._start()
        played = Played()
        try:
            self._conn.send(program)
            while True:
                if not self._conn.poll(self.step_timeout_s):
                    played.died = "timeout"
                    break
                kind, value = self._conn.recv()
                if kind == "step":
                    played.steps.append(value)
                elif kind == "end":
                    return played
                else:  # the play function itself raised: a broken harness, not an observation
                    raise RuntimeError(f"{self.target} failed in the child:\n{value}")
        except (EOFError, OSError):
            pass
        if played.died == "timeout":
            self._proc.kill()
        self._stop()
        if played.died is None:
            code = self._proc.exitcode
            played.died = (
                signal.Signals(-code).name
                if code is not None and code < 0 and -code in signal.valid_signals()
                else f"exit {code}"
            )
        return played

    def _stop(self) -> None:
        """End the child (it keeps its exit code; the next program starts a new one)."""
        self._conn.close()
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._stop()
        self._proc = None


def _serve(target: str, conn: Any) -> None:
    die_with_parent()
    module, _, name = target.partition(":")
    play: Callable[[Any, Callable[[Any], None]], None] = getattr(importlib.import_module(module), name)

    def report(observation: Any) -> None:
        conn.send(("step", observation))

    while True:
        program = conn.recv()
        if program is None:
            return
        try:
            play(program, report)
        except Exception:  # noqa: BLE001 - sent to the parent, which raises it there
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("end", None))
