"""The fault catalogue: every site a run can arm, as data.

A run's faults are a list of :class:`Armed` sites with parameters (from the scenario, ``--fault`` on the command
line, or drawn per seed in swarm mode).  NIXL sites are handed to the fake NIXL's fault board when their step comes;
GC sites are consulted by :mod:`sim.gc` whenever a communicator is dropped.  ``epsim faults`` prints this table.
"""

from __future__ import annotations

import difflib

import math
from dataclasses import dataclass, field
from typing import Any

from fakes.nixl._faults import PARAMS as NIXL_PARAMS
from fakes.nixl._faults import STATUS_BY_NAME as NIXL_STATUS
from fakes.nixl._faults import SITES as NIXL_SITES

from .errors import ScenarioError

# Every GC site also takes ``what``: only drops whose description contains it (``what=buffer``: all2all buffers;
# ``what=communicator``: the communicators dropped at commit, abort and exit, though not a prepared or aborted one
# still held at exit, whose drops are named "prepared" and "aborted"); without it, every drop.
GC_SITES: dict[str, tuple[str, frozenset[str]]] = {
    "gc.late": (
        "a dropped communicator (or all2all buffer) is finalized delay_s later, on a thread of its own process",
        frozenset({"delay_s", "what"}),
    ),
    "gc.cycle": (
        "a dropped communicator (or buffer) sits in a reference cycle until the next planned gc.collect()",
        frozenset({"what"}),
    ),
    "gc.thread": (
        "a dropped communicator (or buffer) is finalized on another thread of its process (async EPLB / prepare)",
        frozenset({"what"}),
    ),
    "gc.never": (
        "a dropped communicator (or buffer) lives until interpreter shutdown, when the fake modules are torn down",
        frozenset({"what"}),
    ),
}
# Faults the harness itself injects into a worker.
WORKER_SITES: dict[str, tuple[str, frozenset[str]]] = {
    "storage.move": (
        "expert_buffer is reallocated right before PREPARE builds the new communicator (as vLLM "
        "main@06-21's switch_and_prepare did), so the new storage was never registered",
        frozenset(),
    ),
    "peer.restart": (
        "a rank's NIXL agents restart under the same names right before PREPARE (new connections, "
        "memory registered again, no peers loaded); peers that kept the old entry must remove it "
        "before loading the name again",
        frozenset(),
    ),
    "device.stream_lag": (
        "a rank's CUDA stream has delay_s (default 0.01) of other work before each expert row "
        "copy of one rebalance, so a READ posted from the CPU can land in expert_buffer before the "
        "copies out of it (vLLM's non_blocking copies; sim/device.py; on a GPU the real backend "
        "queues a sleep kernel)",
        frozenset({"delay_s"}),
    ),
    "all2all.parity_skew": (
        "a rank runs one extra low-latency dispatch on its own (a dummy batch), so its "
        "double-buffer parity runs one ahead of its peers' (DeepEP low latency)",
        frozenset(),
    ),
    "all2all.stale_handle": (
        "a rank combines with the handle of its last dispatch from before the EP size changed, "
        "at its first forward on the new group (DeepEP)",
        frozenset(),
    ),
    "all2all.cleanup_late": (
        "the retired group's all2all buffers are destroyed delay_s later on the background "
        "cleanup thread, while the new group already serves (DeepEP scenarios)",
        frozenset({"delay_s"}),
    ),
}
# A PREPARE's worker faults, in the order they are decided, with what each one moves or restarts.
PREPARE_SITES = (("storage.move", "expert_buffer"), ("peer.restart", "agents"))
COMMON = frozenset({"rank", "times", "at_step"})
# Every drop a worker hands to the GC controller, by name; a GC fault's ``what`` must be part of one of them.
DROPS = (
    "old communicator",
    "aborted communicator",
    "prepared",
    "aborted",
    "communicator at exit",
    "old all2all buffer",
    "all2all buffer at exit",
)

# What a NIXL site does in a simulated run beyond what the fake says of it.
_NIXL_NOTES = {
    "notif.drop": "; no built-in strategy sends notifications, so it fires only for your own",
    "notif.delay": "; no built-in strategy sends notifications, so it fires only for your own",
}
SITES: dict[str, str] = {
    **{f"nixl.{k}": v + _NIXL_NOTES.get(k, "") for k, v in NIXL_SITES.items()},
    **{k: v for k, (v, _) in GC_SITES.items()},
    **{k: v for k, (v, _) in WORKER_SITES.items()},
}


def params_of(site: str) -> frozenset[str]:
    if site in GC_SITES:
        return GC_SITES[site][1] | COMMON
    if site in WORKER_SITES:
        return WORKER_SITES[site][1] | COMMON
    return NIXL_PARAMS[site.removeprefix("nixl.")] | COMMON


@dataclass
class Armed:
    site: str
    params: dict[str, Any] = field(default_factory=dict)
    fired: int = 0
    first_fired_at: float | None = field(default=None, compare=False)  # simulated time of its first firing

    @property
    def times(self) -> int | None:
        return self.params.get("times")

    @property
    def at_step(self) -> int:
        return int(self.params.get("at_step", 0))

    def __str__(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.site}:{args}" if args else self.site


# What each numeric parameter holds, and its least value: checked when a fault is armed, so that a typo is one line
# before the run instead of an exception inside it (where it would read as the code under test crashing).
NUMBERS: dict[str, tuple[type, int]] = {
    "at_step": (int, 0),
    "rank": (int, 0),
    "times": (int, 1),
    "polls": (int, 1),
    "after_posts": (int, 0),
    "delay_s": (float, 0),
    "delay": (float, 0),
}


def validate(site: str, params: dict[str, Any]) -> Armed:
    if site not in SITES:
        close = difflib.get_close_matches(site, list(SITES), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ScenarioError(f"fault site {site!r} not found; {hint}known: {', '.join(SITES)} (see `epsim faults`)")
    unknown = sorted(set(params) - params_of(site))
    if unknown:
        raise ScenarioError(
            f"fault {site}: no parameter {unknown[0]!r}; it takes: {', '.join(sorted(params_of(site)))}"
        )
    for key, value in params.items():
        kind, least = NUMBERS.get(key, (None, 0))
        if kind is None:
            continue
        number = isinstance(value, int) if kind is int else isinstance(value, (int, float))
        if isinstance(value, bool) or not number or not math.isfinite(value) or value < least:
            noun = "a whole number" if kind is int else "a number of seconds" if key == "delay_s" else "a number"
            raise ScenarioError(f"fault {site}: {key}={value!r} must be {noun} >= {least}")
    what = params.get("what")
    if what is not None and not any(str(what) in drop for drop in DROPS):
        raise ScenarioError(
            f"fault {site}: what={what!r} is part of no drop's name, so it would never fire; drops "
            f"are: {', '.join(DROPS)}"
        )
    error = params.get("error")
    if error is not None and error not in NIXL_STATUS:
        raise ScenarioError(f"fault {site}: error={error!r} is not a NIXL status; use one of {', '.join(NIXL_STATUS)}")
    return Armed(site, dict(params))


def parse(text: str) -> Armed:
    """``SITE[:k=v,...]`` from the command line; values become int, float or bool where they look like one."""
    site, colon, rest = text.partition(":")
    params: dict[str, Any] = {}
    if colon and not rest.strip():  # `gc.late:` reads as a parameter list lost on the way (a shell variable)
        raise ScenarioError(f"--fault {text!r}: nothing after ':'; give k=v parameters or leave the ':' out")
    for item in rest.split(",") if colon else ():
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ScenarioError(f"--fault {text!r}: parameters are k=v separated by commas")
        if key.strip() in params:
            raise ScenarioError(f"--fault {text!r}: {key.strip()} is given twice")
        params[key.strip()] = _value(raw.strip())
    return validate(site.strip(), params)


def _value(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def check_fits(armed: list[Armed], scenario, option: str = "--fault") -> None:
    """Faults given on the command line that could never fire in ``scenario``: one line, before the run.  (A
    bundle's or a shrunk scenario's faults are not checked: shrinking keeps a fault that stopped firing.)"""
    processes = scenario.processes()
    for a in armed:
        if a.at_step >= scenario.steps:
            raise ScenarioError(
                f"{option} {a}: at_step {a.at_step} is not before the scenario's steps = "
                f"{scenario.steps}, so it would never fire"
            )
        if "rank" in a.params and int(a.params["rank"]) >= processes:
            raise ScenarioError(
                f"{option} {a}: rank {a.params['rank']} never exists; the scenario starts rank "
                f"processes 0..{processes - 1} (a scale-up's new ranks take new numbers)"
            )
        if a.site.startswith("all2all.") and scenario.all2all.backend == "none":
            raise ScenarioError(f"{option} {a}: the scenario has no all2all buffers (set all2all.backend)")
        if a.site == "all2all.parity_skew" and scenario.all2all.backend != "deepep_low_latency":
            raise ScenarioError(
                f"{option} {a}: only low-latency buffers have a double-buffer parity (set "
                "all2all.backend=deepep_low_latency)"
            )


def arm(specs, extra=()) -> list[Armed]:
    """A run's armed faults: the scenario's fault specs (``FaultSpec``), then ``extra`` (``SITE:k=v`` strings from
    the command line, or ``Armed``), every one validated."""
    armed = [
        validate(
            f.site,
            {**f.params, **({"at_step": f.at_step} if f.at_step else {}), **({"times": f.times} if f.times else {})},
        )
        for f in specs
    ]
    armed += [f if isinstance(f, Armed) else parse(f) for f in extra]
    refuse_twice(armed)
    return armed


def refuse_twice(armed: list[Armed]) -> None:
    """One line for a fault armed twice: its firings would be counted together under one name in faults_fired."""
    seen: set[str] = set()
    for a in armed:
        if str(a) in seen:
            raise ScenarioError(
                f"fault {a} is armed twice (counting the scenario's own faults); arm it "
                "once, with times=N for N firings"
            )
        seen.add(str(a))


class FaultPlan:
    """The faults of one run: arms NIXL sites on the fabric at their step, answers GC sites when asked."""

    def __init__(self, armed: list[Armed], fabric, history) -> None:
        self.armed = armed
        self.fabric = fabric
        self.history = history
        self._nixl_pending = sorted((a for a in armed if a.site.startswith("nixl.")), key=lambda a: a.at_step)
        self._nixl_live: list[tuple[Armed, Any]] = []
        self.healing = False
        self.step = 0  # the engine's current forward step: a GC or worker fault applies from its at_step on

    def at_step(self, step: int) -> None:
        self.step = step
        while self._nixl_pending and self._nixl_pending[0].at_step <= step and not self.healing:
            a = self._nixl_pending.pop(0)
            kwargs = {k: v for k, v in a.params.items() if k not in COMMON}
            # rank N: only the agents of rank process N trip it (the one initiating a transfer or a notification,
            # or registering memory)
            pid = int(a.params["rank"]) if "rank" in a.params else None
            board = self.fabric.faults.arm(a.site.removeprefix("nixl."), times=a.times, pid=pid, **kwargs)
            self._nixl_live.append((a, board))
            self.history.record("fault.arm", site=a.site)

    def next_step(self, after: int) -> float:
        """The step at which the next NIXL fault is armed, if later than ``after`` (inf if none)."""
        later = [a.at_step for a in self._nixl_pending if a.at_step > after]
        return min(later) if later else math.inf

    def take_gc(self, pid: int, what: str) -> Armed | None:
        return self.take(GC_SITES, pid, what)

    def take_prepare(self, pid: int, build_step: int | None) -> dict[str, bool]:
        """Whether each of a PREPARE's worker faults fires for process ``pid`` (site -> fired), decided when PREPARE
        is posted for ``build_step``, the step its window ends at and it builds: one decision for both worlds (the
        simulated PREPARE builds at that step, real ranks at once)."""
        return {
            site: self.take({site: WORKER_SITES[site]}, pid, what, build_step) is not None
            for site, what in PREPARE_SITES
        }

    def take(self, sites, pid: int, what: str, step: int | None = None) -> Armed | None:
        """The first armed fault among ``sites`` that applies to process ``pid`` now, marked as fired.  ``step``: the
        forward step the faulted action belongs to, when that is not the engine's current one (a PREPARE's build
        belongs to the end of its window: both worlds decide its faults when it is posted, for that step)."""
        if self.healing:
            return None
        for a in self.armed:
            if a.site not in sites or (a.times is not None and a.fired >= a.times):
                continue
            if "rank" in a.params and int(a.params["rank"]) != pid:
                continue
            if "what" in a.params and str(a.params["what"]) not in what:
                continue
            if a.at_step > (self.step if step is None else step):
                continue
            a.fired += 1
            if a.first_fired_at is None:
                a.first_fired_at = self.fabric.now()
            self.history.record("fault.fire", site=a.site, pid=pid, what=what)
            return a
        return None

    def heal(self) -> None:
        """The healing phase: nothing fires any more."""
        self.healing = True
        self.fabric.faults.disarm_all()
        self.history.record("fault.heal")

    def first_fired(self) -> list[tuple[float, int, Armed]]:
        """(simulated time of its first firing, position in the armed list, fault) of every fault that fired."""
        out = [(a.first_fired_at, i, a) for i, a in enumerate(self.armed) if a.first_fired_at is not None]
        boards = {id(a): board for a, board in self._nixl_live}
        for i, a in enumerate(self.armed):
            board = boards.get(id(a))
            if board is not None and board.first_fired_at is not None:
                out.append((board.first_fired_at, i, a))
        return sorted(out, key=lambda x: (x[0], x[1]))

    def fired(self) -> dict[str, int]:
        counts = {str(a): a.fired for a in self.armed if a.site in GC_SITES or a.site in WORKER_SITES}
        for a, board in self._nixl_live:
            counts[str(a)] = board.fired
        for a in self._nixl_pending:
            counts[str(a)] = 0
        return counts
