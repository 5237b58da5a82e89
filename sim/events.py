"""The history's record types: every kind of event a run's history holds, the fields it carries and what it means.

A history record is ``(t, kind, fields)`` (:mod:`sim.trace`). This module is the one list of the kinds: the simulated
cluster's history and the history the real judge replays a real run into are checked against it, and
``docs/history.md`` is rendered from it (and checked against it). A kind that only one world records says so
(``worlds``); a field only one world gives is ``NotRequired``.

Each kind is a ``TypedDict`` of its fields, so the fields stay plain data (the trace hash is computed over them) and a
record costs nothing to make. :func:`check` validates one record against its type (pydantic, strict, no extra
fields); with ``EPSIM_CHECK_EVENTS=1`` every history checks every record it is given (the test suite runs that way),
and a new kind, a renamed field or a field of another type ends the run as an internal error that names the record,
instead of being skipped by a reader that matches on the old name.
"""

# (No ``from __future__ import annotations``: TypedDict reads NotRequired off evaluated annotations.)
import os
import types
import typing
from typing import Any, Callable, Literal

# typing_extensions' TypedDict (pydantic needs it before Python 3.12; pydantic itself depends on it)
from typing_extensions import NotRequired, TypedDict

World = Literal["both", "sim", "real"]


class Kind:
    """A kind's name, its record type and which worlds record it."""

    def __init__(self, name: str, record: type, worlds: World) -> None:
        self.name, self.record, self.worlds = name, record, worlds
        self.doc = " ".join((record.__doc__ or "").split())
        self._adapter: Any = None

    def validate(self, fields: dict[str, Any]) -> None:
        if self._adapter is None:  # built on first use: pydantic stays out of runs that never check
            from pydantic import ConfigDict, TypeAdapter, with_config

            self._adapter = TypeAdapter(with_config(ConfigDict(extra="forbid", strict=True))(self.record))
        self._adapter.validate_python(fields)


KINDS: dict[str, Kind] = {}


def kind(name: str, worlds: World = "both") -> Callable[[type], type]:
    def register(record: type) -> type:
        assert name not in KINDS, f"kind {name} registered twice"
        KINDS[name] = Kind(name, record, worlds)
        return record

    return register


# -- the engine: the scenario's timeline, as the engine drives it (one world or the other) ------------------------


@kind("engine.serve")
class EngineServe(TypedDict):
    """The group serves ``steps`` forward steps from ``step`` on (a chunk of the timeline)."""

    step: int
    steps: int


@kind("engine.rebalance")
class EngineRebalance(TypedDict):
    """EPLB's periodic rebalance at ``step``: the new placement (a short hash) over ``ep_size`` ranks; ``skipped``
    (only when so): vLLM on ROCm found it gains under 5% and moves nothing."""

    step: int
    ep_size: int
    placement: str
    skipped: NotRequired[bool]


@kind("engine.members")
class EngineMembers(TypedDict):
    """The members (pids) of a new EPLB group ``group``."""

    group: str
    members: list[int]


class _Elastic(TypedDict):
    step: int
    to: int | None
    rank: int | None


@kind("engine.scale_up")
class EngineScaleUp(_Elastic):
    """A scale-up to ``to`` ranks starts at ``step`` (the timeline's event)."""


@kind("engine.scale_down")
class EngineScaleDown(_Elastic):
    """A scale-down to ``to`` ranks starts at ``step``."""


@kind("engine.abort")
class EngineAbort(_Elastic):
    """A reconfiguration to ``to`` ranks that is aborted after PREPARE starts at ``step``."""


@kind("engine.fail_rank")
class EngineFailRank(_Elastic):
    """Rank ``rank`` fails (its process is killed) at ``step``."""


@kind("engine.reconfigured", worlds="real")
class EngineReconfigured(TypedDict):
    """A reconfiguration completed with these members (the judge's point for the stale-peer check)."""

    members: list[int]


@kind("engine.stuck", worlds="real")
class EngineStuck(TypedDict):
    """The parent stopped waiting for ``what`` (a command, or PREPARE): ``pids`` never answered."""

    what: str
    pids: list[int]


@kind("engine.shutdown")
class EngineShutdown(TypedDict):
    """The run's last step: every rank exits."""

    step: int


# -- processes and threads --------------------------------------------------------------------------------------


@kind("process.start", worlds="real")
class ProcessStart(TypedDict):
    """Rank process ``pid`` (OS pid ``os_pid``) started as ``rank`` (forked by the zygote, or a fresh interpreter);
    a torchrun slot on another host gives its clock's offset and bound."""

    pid: int
    os_pid: int
    rank: int
    started_as: str
    clock_offset_s: NotRequired[float]
    clock_bound_s: NotRequired[float]


@kind("process.exit", worlds="real")
class ProcessExit(TypedDict):
    """Rank process ``pid`` ended with exit status ``code``."""

    pid: int
    code: int | None


@kind("process.kill")
class ProcessKill(TypedDict):
    """Process ``pid`` was killed: in the simulation with the threads it still had, on real ranks by ``signal``."""

    pid: int
    threads: NotRequired[list[str]]
    signal: NotRequired[str]
    why: NotRequired[str]


@kind("thread.start", worlds="sim")
class ThreadStart(TypedDict):
    """A simulated thread of ``pid`` starts."""

    pid: int
    thread: str


@kind("thread.end", worlds="sim")
class ThreadEnd(TypedDict):
    """A simulated thread of ``pid`` ends."""

    pid: int
    thread: str


@kind("thread.crash")
class ThreadCrash(TypedDict):
    """An exception escaped ``thread`` of ``pid`` (a real rank also names its type; its traceback and frames stay
    out of the history)."""

    pid: int
    thread: str
    error: str
    type: NotRequired[str]


@kind("interpreter.shutdown", worlds="sim")
class InterpreterShutdown(TypedDict):
    """The simulated interpreters shut down with ``objects`` still to finalize."""

    objects: int


@kind("finalizer.error", worlds="sim")
class FinalizerError(TypedDict):
    """A finalizer raised (Python prints it and goes on): where, and what."""

    where: str
    error: str


# -- vLLM's worker: communicators, EPLB, the all2all ----------------------------------------------------------


@kind("comm.create")
class CommCreate(TypedDict):
    """``pid`` made its EPLB communicator of generation ``gen`` (``prev``: while the previous one is alive)."""

    pid: int
    gen: str
    prev: bool


@kind("comm.swap")
class CommSwap(TypedDict):
    """``pid`` switched to the communicator of generation ``gen`` (COMMIT)."""

    pid: int
    gen: str


@kind("comm.abort")
class CommAbort(TypedDict):
    """``pid`` aborted its prepared communicator."""

    pid: int


@kind("eplb.rearranged")
class EplbRearranged(TypedDict):
    """``pid`` finished a rebalance of ``moved_layers`` layers."""

    pid: int
    moved_layers: int


@kind("eplb.skipped")
class EplbSkipped(TypedDict):
    """``pid`` skipped a rebalance (vLLM's decision, as the model's)."""

    pid: int


@kind("eplb.postponed")
class EplbPostponed(TypedDict):
    """A rebalance due while one was in flight waited ``steps`` steps for it (vLLM 0.33.0)."""

    pid: int
    steps: int


@kind("eplb.stopped")
class EplbStopped(TypedDict):
    """An async rebalance stopped before ``layer`` (its communicator went away)."""

    pid: int
    layer: int


@kind("eplb.moved", worlds="real")
class EplbMoved(TypedDict):
    """A real rank's rebalance moved its experts in ``seconds``."""

    pid: int
    seconds: float


@kind("eplb.checked", worlds="real")
class EplbChecked(TypedDict):
    """A real rank checked its expert weights after a rebalance: ``count`` wrong rows, the first of them."""

    pid: int
    count: int
    problems: list[str]


@kind("all2all.checked", worlds="real")
class All2allChecked(TypedDict):
    """A real rank's MoE forward through the DeepEP buffer against the reference: the difference, or None."""

    pid: int
    problem: str | None


@kind("all2all.cleanup")
class All2allCleanup(TypedDict):
    """The elastic cleanup destroyed the retired group's all2all manager: ``destroyed`` buffers."""

    pid: int
    destroyed: int


@kind("storage.move")
class StorageMove(TypedDict):
    """Fault: ``what`` (the expert buffer) moved to new storage in PREPARE."""

    pid: int
    what: str


@kind("peer.restart")
class PeerRestart(TypedDict):
    """Fault: the NIXL agents of ``pid`` restarted in PREPARE (new metadata under the same names)."""

    pid: int
    agents: list[str]


@kind("worker.exit")
class WorkerExit(TypedDict):
    """``pid``'s worker exited (a real rank lists the agents still alive that nothing held on purpose)."""

    pid: int
    leaked: NotRequired[list[str]]


# -- garbage collection ------------------------------------------------------------------------------------------


@kind("gc.drop")
class GcDrop(TypedDict):
    """``pid`` dropped its last reference to ``what``; ``how`` it is finalized (refcount, or a GC fault)."""

    pid: int
    what: str
    how: str


@kind("gc.finalize")
class GcFinalize(TypedDict):
    """``what`` of ``pid`` was finalized late (by a GC fault's release)."""

    pid: int
    what: str
    how: str


@kind("gc.collect")
class GcCollect(TypedDict):
    """A planned ``gc.collect()`` (vLLM's, at ``reason``); ``pid`` None: every process's."""

    pid: int | None
    reason: str


# -- the device stream ------------------------------------------------------------------------------------------


@kind("device.sync", worlds="sim")
class DeviceSync(TypedDict):
    """``pid`` synchronised its stream (``reason``): ``copies`` queued copies landed, the first of them named."""

    pid: int
    reason: str
    copies: int
    first: str


@kind("device.flush", worlds="sim")
class DeviceFlush(TypedDict):
    """``pid``'s queued copies landed without a synchronisation (``reason``)."""

    pid: int
    reason: str
    copies: int
    first: str


# -- faults ------------------------------------------------------------------------------------------------------


@kind("fault.arm", worlds="sim")
class FaultArm(TypedDict):
    """A fake NIXL fault at ``site`` is armed, at its step."""

    site: str


@kind("fault.fire")
class FaultFire(TypedDict):
    """The fault at ``site`` fired on ``pid`` (on ``what``); on real ranks, a GC or PREPARE fault the parent chose."""

    pid: int
    site: str
    what: str


@kind("fault.heal")
class FaultHeal(TypedDict):
    """Faults stop firing: the run's tail serves without them."""


# -- collectives -------------------------------------------------------------------------------------------------


@kind("collective.arrive", worlds="sim")
class CollectiveArrive(TypedDict):
    """Rank ``rank`` (``pid``) arrived at collective ``seq`` (``op``) of ``group``."""

    pid: int
    group: str
    op: str
    seq: int
    rank: int


class _CollectiveLate(TypedDict):
    pid: int
    group: str
    op: str
    seq: int
    missing: list[int]


@kind("collective.timeout", worlds="sim")
class CollectiveTimeout(_CollectiveLate):
    """Collective ``seq`` of ``group`` timed out on ``pid``: the pids in ``missing`` never arrived."""


@kind("collective.wait_timeout", worlds="sim")
class CollectiveWaitTimeout(_CollectiveLate):
    """``Work.wait(timeout)`` of collective ``seq`` ran out on ``pid``."""


# -- NIXL (the fake fabric's events, or a real rank's ledger) ---------------------------------------------------


class _Agent(TypedDict):
    agent: str
    pid: int


@kind("nixl.config", worlds="real")
class NixlConfig(TypedDict):
    """The NIXL package a real rank imported and the progress thread's delay it runs with."""

    pid: int
    package: str
    progress_delay_us: int


@kind("nixl.agent.create")
class NixlAgentCreate(_Agent):
    """A NIXL agent was made."""


@kind("nixl.agent.destroy")
class NixlAgentDestroy(_Agent):
    """A NIXL agent was destroyed (``why``: its process ended, on real ranks)."""

    why: NotRequired[str]


@kind("nixl.agent.restart", worlds="sim")
class NixlAgentRestart(_Agent):
    """A NIXL agent restarted (the peer.restart fault)."""


@kind("nixl.agent.threads")
class NixlAgentThreads(_Agent):
    """The agent was called by one thread while another held open transfer requests on it."""


class _Regions(_Agent):
    regions: int


@kind("nixl.register")
class NixlRegister(_Regions):
    """The agent registered ``regions`` memory regions."""


@kind("nixl.deregister")
class NixlDeregister(_Regions):
    """The agent deregistered ``regions`` memory regions."""


@kind("nixl.deregister.refused")
class NixlDeregisterRefused(_Regions):
    """NIXL refused to deregister ``regions`` regions (not registered, or released already)."""


class _Peer(_Agent):
    peer: str


@kind("nixl.peer.load")
class NixlPeerLoad(_Peer):
    """The agent loaded ``peer``'s metadata (``sections``: how many, in the simulation)."""

    sections: NotRequired[int]


@kind("nixl.peer.remove")
class NixlPeerRemove(_Peer):
    """The agent invalidated ``peer``'s metadata."""


@kind("nixl.peer.fail", worlds="sim")
class NixlPeerFail(_Peer):
    """A transfer from ``peer`` failed (``why``)."""

    why: str


class _Xfer(_Peer):
    op: str
    nbytes: int


@kind("nixl.xfer.post")
class NixlXferPost(_Xfer):
    """The agent posted a transfer (``op``, READ or WRITE) of ``nbytes`` from or to ``peer``."""


@kind("nixl.xfer.done")
class NixlXferDone(_Xfer):
    """That transfer completed."""


@kind("nixl.process.spawn", worlds="sim")
class NixlProcessSpawn(TypedDict):
    """The fake fabric gave a process its id."""

    pid: int


@kind("nixl.process.kill", worlds="sim")
class NixlProcessKill(TypedDict):
    """The fake fabric took a killed process's agents away."""

    pid: int


# -- DeepEP (the fake's buffers, or a real rank's warning) ------------------------------------------------------


class _Team(TypedDict):
    pid: int
    team: str


@kind("deep_ep.buffer", worlds="sim")
class DeepEpBuffer(_Team):
    """A DeepEP buffer of ``size`` ranks was made on ``team`` (``nvshmem``: its world size, if it joined one)."""

    size: int
    low_latency: bool
    nvshmem: int | None


@kind("deep_ep.arrive", worlds="sim")
class DeepEpArrive(_Team):
    """``pid`` arrived at the buffer's collective ``seq`` (``op``)."""

    op: str
    seq: int


@kind("deep_ep.timeout", worlds="sim")
class DeepEpTimeout(_Team):
    """The buffer's collective ``seq`` timed out on ``pid``: ``missing`` never came."""

    op: str
    seq: int
    missing: list[int]


@kind("deep_ep.destroy", worlds="sim")
class DeepEpDestroy(_Team):
    """``destroy()`` tore the buffer down."""


@kind("deep_ep.destroy_at_exit", worlds="sim")
class DeepEpDestroyAtExit(_Team):
    """The buffer's destructor ran its collective destroy at interpreter exit."""


@kind("deep_ep.destroy_uninitialised", worlds="sim")
class DeepEpDestroyUninitialised(TypedDict):
    """The destructor of a buffer whose constructor failed early (CUDA's illegal-address error)."""

    pid: int


@kind("deep_ep.leak")
class DeepEpLeak(_Team):
    """A buffer made with ``explicitly_destroy=True`` was dropped without ``destroy()`` (DeepEP's warning)."""


# -- the oracles' findings ---------------------------------------------------------------------------------------


@kind("oracle.violation")
class OracleViolation(TypedDict):
    """An invariant failed: the verdict, the invariant and what was seen."""

    verdict: str
    invariant: str
    detail: str


@kind("oracle.duplicate_registration")
class OracleDuplicateRegistration(_Agent):
    """The agent registered pages that ``other`` (the same agent, or another of the process) holds."""

    other: str
    same_agent: bool


class UnknownEvent(Exception):
    """A record of a kind this module does not list, or whose fields are not its kind's."""


def check(kind: str, fields: dict[str, Any]) -> None:
    """Raise :class:`UnknownEvent` unless ``fields`` are exactly ``kind``'s, of its types."""
    found = KINDS.get(kind)
    if found is None:
        raise UnknownEvent(f"history record of unknown kind {kind!r} (sim/events.py lists the kinds)")
    try:
        found.validate(fields)
    except Exception as exc:  # pydantic's ValidationError
        errors = exc.errors() if hasattr(exc, "errors") else [{"loc": (), "msg": str(exc)}]
        why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in errors)
        raise UnknownEvent(f"history record {kind!r} {fields!r} is not a {found.record.__name__} ({why})") from None


def checking() -> bool:
    """Whether histories check each record as it comes (``EPSIM_CHECK_EVENTS=1``)."""
    return os.environ.get("EPSIM_CHECK_EVENTS", "") not in ("", "0")


def render_reference() -> str:
    """``docs/history.md``: every kind, the worlds that record it, its fields and what it means."""
    out = [
        "# The history's events",
        "",
        "Every record of a run's history (`history.jsonl` in an `--out` folder, the Perfetto trace, the trace hash) is",
        "`(t, kind, fields)`. These are the kinds and their fields, for the simulation and for real runs (whose ranks'",
        "events the judge merges into the same history). Rendered from `sim/events.py`; the test suite checks every",
        "record it makes against it. A field marked optional is left out by one world, or where it would say nothing.",
        "",
        "| kind | recorded by | fields | what it means |",
        "| --- | --- | --- | --- |",
    ]
    where = {"both": "both worlds", "sim": "simulation", "real": "real runs"}
    for k in KINDS.values():
        out.append(f"| `{k.name}` | {where[k.worlds]} | {_fields(k.record)} | {k.doc.replace('``', '`')} |")
    return "\n".join(out) + "\n"


def _fields(record: type) -> str:
    optional: frozenset[str] = getattr(record, "__optional_keys__", frozenset())
    shown = [
        f"`{name}`: {_type(hint)}" + (" (optional)" if name in optional else "")
        for name, hint in record.__annotations__.items()
    ]
    return ", ".join(shown) or "none"


def _type(hint: Any) -> str:
    """``int``, ``list of int``, ``str or None``: a field's type in words (NotRequired unwrapped)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is NotRequired:
        return _type(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args)
    if origin is list:
        return f"list of {_type(args[0])}"
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))
