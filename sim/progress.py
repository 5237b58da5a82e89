"""A progress line on stderr for long runs (`epsim run deepseek-v3-ep64` takes over a minute).

The engine reports (step, simulated seconds) between lifecycle events; the line shows steps done, simulated time
and how much faster than real time the run goes.  It reads the real clock, captured here before the kernel replaces
``time``'s functions with simulated ones inside a run, and never touches the run's history: a run with and
without the line has the same trace hash.  Nothing is drawn unless stderr is a terminal.
"""

from __future__ import annotations

from time import perf_counter as _wall  # the real clock: bound before any run patches the time module

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column

_EVERY_S = 0.25  # redraw at most this often (wall seconds)


class _Bar:
    """A rich progress display on stderr, drawn only when stderr is a terminal, started and stopped as a context."""

    def __init__(self, *columns, **options) -> None:
        console = Console(stderr=True)
        self.enabled = console.is_terminal
        self._progress = Progress(*columns, console=console, **options)
        self._started = _wall()

    def __enter__(self):
        if self.enabled:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._progress.stop()


def run_columns(steps: int) -> tuple:
    """The columns of a run's line.  On an 80-column terminal rich's defaults squeezed the step count to "750/7…":
    the bar is narrower, and the count never shortens (the speed text gives way first)."""
    return (
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=16),
        MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=2 * len(str(steps)) + 1)),
        TextColumn("steps · {task.fields[sim]}"),
        TimeElapsedColumn(),
    )


class RunProgress(_Bar):
    def __init__(self, scenario: str, steps: int) -> None:
        super().__init__(*run_columns(steps), transient=True, auto_refresh=False)
        self._task = self._progress.add_task(scenario, total=steps, sim="")
        self._drawn = 0.0

    def __call__(self, step: int, sim_s: float) -> None:
        if not self.enabled:
            return
        now = _wall()
        if now - self._drawn < _EVERY_S:
            return
        self._drawn = now
        speed = sim_s / max(now - self._started, 1e-9)
        self._progress.update(self._task, completed=step, sim=f"{sim_s:,.0f} s simulated · {speed:,.0f}x")
        self._progress.refresh()


def sweep_columns(total: int) -> tuple:
    """The columns of a sweep's line, fitted to 80 columns as :func:`run_columns` is."""
    whole = Column(no_wrap=True, min_width=2 * len(str(total)) + 1)
    return (
        TextColumn("[bold]sweep"),
        BarColumn(bar_width=16),
        MofNCompleteColumn(table_column=whole),
        TextColumn("runs · {task.fields[failures]} failed · {task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("·"),
        TimeRemainingColumn(table_column=Column(no_wrap=True, min_width=7)),
        TextColumn("left"),
    )


class SweepProgress(_Bar):
    """Runs done of planned, failures so far, runs per second and time left, on stderr when it is a terminal."""

    def __init__(self, total: int) -> None:
        super().__init__(*sweep_columns(total), transient=False)
        self._task = self._progress.add_task("sweep", total=total, failures=0, rate="")
        self._done = self._failures = 0

    def __call__(self, row: dict) -> None:
        self._done += 1
        self._failures += row["verdict"] != "pass"
        if self.enabled:
            rate = self._done / max(_wall() - self._started, 1e-9)
            self._progress.update(self._task, advance=1, failures=self._failures, rate=f"{rate:.1f}/s")
