"""Fake ``torch.distributed`` process groups that run inside the simulation kernel.

Each simulated rank holds its own :class:`FakeProcessGroup` (as each real process holds its own ProcessGroup); the
members of one group share a :class:`Rendezvous`.  Collectives match by sequence number: the k-th collective a rank
issues on a group meets the k-th of every other member.  Objects cross "processes" as copies (tensors cloned, lists
and dicts rebuilt around shared immutable leaves, anything else pickled), so no simulated rank ever aliases another's
mutable objects.  A collective that some member never reaches raises :class:`CollectiveTimeout` once the group's
timeout has passed since its first member arrived (vLLM's EPLB barrier waits 5 minutes), naming the missing ranks.

Groups are stateless, as vLLM's elastic EP groups are (a ``ProcessGroup`` made outside ``new_group``, not registered
in torch's world map): ``group.rank()``, ``get_world_size(group)``, the collectives and ``broadcast_object_list(...,
group_src=)`` work on them, while ``get_rank(group)`` and ``broadcast_object_list(..., src=)`` (a global rank) raise
the ValueError torch raises.  As with gloo, a collective that timed out leaves the group's connections closed (every
later collective on it fails at once, a late arrival included, and the other members' waits end), and a collective
whose contributions do not fit together (shapes, dtypes, list lengths, roots) fails on every member instead of leaving
the others waiting.  A member's process that ends (killed, or exited) closes its connections: the other members'
collectives on its groups, in flight or later, fail at once with "connection closed by peer" (:func:`process_gone`).
``Work.wait(timeout)`` raises "Operation timed out!" when its own bound passes and leaves the collective and the group
as they were: the collective completes when the last member arrives, and a later ``wait()`` returns (a zero timeout
is no bound).  Checked on gloo (torch 2.13, stateless groups, a member killed with SIGKILL;
``tests/conformance/test_process_groups.py`` runs the same cases on both).

``with installed():`` makes ``torch.distributed.all_gather_object`` and friends dispatch to these fakes when the
``group`` argument is a fake group, and to the real functions otherwise, so code written against
``torch.distributed`` runs unmodified.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

ReduceOps = ("SUM", "MAX", "MIN", "PRODUCT", "AVG", "BAND", "BOR", "BXOR")
_BITWISE = ("BAND", "BOR", "BXOR")


class CollectiveTimeout(RuntimeError):
    """A collective that not every member reached in time (a liveness failure, not a hang)."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


class ConnectionClosed(CollectiveTimeout):
    """A member's process ended: gloo's "Connection closed by peer", on every collective of its groups."""


class CollectiveMismatch(RuntimeError):
    """Members issued different collectives at the same position (real backends hang or corrupt data here)."""


@dataclass
class _Op:
    kind: str
    seq: int
    args: dict[int, Any] = field(default_factory=dict)  # group rank -> contribution
    done: Any = None  # simpy event, value = result per rank
    deadline: Any = None  # simpy timeout from the first arrival: one watchdog per collective, not per waiter
    deadline_at: float = math.inf  # when it fires
    copiers: dict = field(default_factory=dict)  # id(result) -> a function copying it, while the results live
    error: tuple[int, BaseException] | None = None  # (the rank that combined, what combining raised)


_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})


def _shareable(value: Any) -> bool:
    """Deeply immutable (atoms of exact builtin types, and tuples or frozensets of them): a copy may share it."""
    t = type(value)
    return t in _ATOMS or ((t is tuple or t is frozenset) and all(map(_shareable, value)))


def _copier(value: Any) -> Callable[[], Any]:
    """A function that returns a fresh copy of ``value`` each call: new lists and dicts, the same immutable leaves
    (no rank can tell a shared str or tuple from its own).  Anything else, or a structure holding one mutable object
    twice (whose aliasing a copy must keep), is serialized once and deserialized per call."""
    seen: set[int] = set()

    def build(v: Any) -> Callable[[], Any] | None:
        if _shareable(v):
            return lambda: v
        t = type(v)
        if t is not list and t is not dict or id(v) in seen:
            return None
        seen.add(id(v))
        if t is list:
            if all(map(_shareable, v)):
                return v.copy
            parts: list[Any] = [build(x) for x in v]
            return None if None in parts else (lambda: [p() for p in parts])
        if not all(map(_shareable, v)):  # keys
            return None
        if all(map(_shareable, v.values())):
            return v.copy
        items: list[tuple[Any, Any]] = [(k, build(x)) for k, x in v.items()]
        return None if any(p is None for _, p in items) else (lambda: {k: p() for k, p in items})

    made = build(value)
    if made is None:
        blob = pickle.dumps(value)
        return lambda: pickle.loads(blob)
    return made


def _copy(value: Any, copiers: dict[int, Callable[[], Any]] | None = None) -> Any:
    """What crosses from one simulated process to another: a copy, never the object itself.  ``copiers`` caches a
    copier per result (by id, while the results live), so one result that every rank receives (all_gather_object's
    list) is examined once and copied per rank at C speed: at EP256 every rank receives every rank's metadata."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().clone()
    if copiers is None:
        return pickle.loads(pickle.dumps(value))
    copier = copiers.get(id(value))
    if copier is None:
        copier = copiers[id(value)] = _copier(value)
    return copier()


class Rendezvous:
    """What the members of one group generation share."""

    def __init__(
        self,
        kernel,
        name: str,
        pids: list[int],
        timeout_s: float = 300.0,
        latency_s: float | Callable[[str], float] = 0.0,
    ) -> None:
        self.kernel, self.name, self.pids, self.timeout_s = kernel, name, list(pids), timeout_s
        # From the last arrival to the result (a calibration measures gloo's): seconds, or asked of a callable with
        # the collective's kind when it completes (an object collective pickles and makes two; the cost depends on
        # how many processes share the host then).
        self.latency_s = latency_s
        self._ops: dict[int, _Op] = {}
        self._next_seq = [0] * len(pids)
        self._destroyed = False
        self._siblings: dict[str, Rendezvous] = {}
        self.broken: str | None = None  # why the group's connections closed; every later collective fails at once
        self._gone: int | None = None  # the member whose process ended, when that is why
        self._closed = None  # the event that wakes every wait on the group when it closes (made on first use)
        _live.setdefault(kernel, []).append(weakref.ref(self))

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    @destroyed.setter
    def destroyed(self, value: bool) -> None:
        self._destroyed = value
        for sibling in self._siblings.values():
            sibling.destroyed = value

    def sibling(self, kind: str) -> "Rendezvous":
        """Another group over the same members, made on first use and destroyed with this one: vLLM builds a
        generation's EP group and its EPLB group side by side, and a thread's collectives on one never match
        another thread's on the other."""
        found = self._siblings.get(kind)
        if found is None:
            found = self._siblings[kind] = Rendezvous(
                self.kernel, f"{self.name}/{kind}", self.pids, self.timeout_s, self.latency_s
            )
            found.destroyed = self._destroyed
        return found

    def _closed_event(self):
        """Triggered when the group's connections close (:meth:`_close`): every wait on the group ends then."""
        if self._closed is None:
            self._closed = self.kernel.env.event()
        return self._closed

    def _close(self, reason: str, gone: int | None = None) -> None:
        if self.broken is None:
            self.broken, self._gone = reason, gone
        closed = self._closed
        # Only waits in progress need waking; a later call or wait sees ``broken`` first.  So a group closed with
        # no one waiting (a member exiting after the group's last collective) schedules nothing and draws no
        # tie-break: the rest of the run's history is what it would be without the close.
        if closed is not None and closed.callbacks and not closed.triggered:
            closed.succeed()

    def _closed_error(self, what: str) -> RuntimeError:
        message = f"{what} on group {self.name}: connection closed by peer ({self.broken})"
        if self._gone is not None:  # a liveness failure, as the real backend's judge calls gloo's own error
            return ConnectionClosed(message, [self.pids.index(self._gone)])
        return RuntimeError(message)

    def groups(self) -> list["FakeProcessGroup"]:
        return [FakeProcessGroup(self, r) for r in range(len(self.pids))]

    def run(
        self, rank: int, kind: str, contribution: Any, combine, private: bool = False, timeout_s: float | None = None
    ) -> Any:
        """Issue this rank's collective ``kind`` and wait for its result.  ``private``: the caller only reads the
        result (all_reduce copies it into the rank's own tensor), so it is not copied for each rank."""
        return self.finish(self.arrive(rank, kind, contribution, combine), rank, private, timeout_s)

    def arrive(self, rank: int, kind: str, contribution: Any, combine) -> _Op:
        """Issue this rank's collective without waiting for it (``async_op=True`` returns here)."""
        if self.destroyed:
            raise RuntimeError(f"{kind} on destroyed group {self.name}")
        if self.broken is not None:
            raise self._closed_error(kind)
        caller = self.kernel.current()
        if caller is not None and caller.pid != self.pids[rank]:
            # Processes share no objects: a group handle used by another process is a bug in the caller, which
            # would otherwise take that member's place in the collective.
            raise RuntimeError(
                f"{kind} on group {self.name}: pid {caller.pid} used the handle of rank {rank} (pid {self.pids[rank]})"
            )
        mine = _copy(contribution)  # serialized before anything is sent: an object that cannot be is refused here
        seq = self._next_seq[rank]
        self._next_seq[rank] += 1
        op = self._ops.get(seq)
        if op is None:
            env = self.kernel.env
            op = self._ops[seq] = _Op(
                kind, seq, done=env.event(), deadline=env.timeout(self.timeout_s), deadline_at=env.now + self.timeout_s
            )
        elif op.kind != kind:
            raise CollectiveMismatch(
                f"collective #{seq} on group {self.name}: rank {rank} issued {kind}, others {op.kind}"
            )
        op.args[rank] = mine
        self.kernel.history.record(
            "collective.arrive", group=self.name, op=kind, seq=seq, pid=self.pids[rank], rank=rank
        )
        if len(op.args) == len(self.pids):
            try:
                results = combine([op.args[r] for r in range(len(self.pids))])
            except Exception as exc:  # contributions that do not fit: every member fails, none waits for ever
                op.error, results = (rank, exc), None
                self._close(f"collective #{seq} failed on rank {rank}")
            del self._ops[seq]
            latency = self.latency_s(kind) if callable(self.latency_s) else self.latency_s
            if latency > 0:
                self.kernel.env.timeout(latency).callbacks.append(
                    lambda _, done=op.done, results=results: done.succeed(results)
                )
            else:
                op.done.succeed(results)
        return op

    def finish(self, op: _Op, rank: int, private: bool = False, timeout_s: float | None = None) -> Any:
        """Wait for ``op`` (issued by :meth:`arrive`) and return this rank's result.  ``timeout_s``: the bound of a
        ``Work.wait(timeout)``; when it passes before the collective's own deadline, "Operation timed out!" is
        raised and the collective and the group are left as they are, as gloo does (a bound that ends at or after
        the deadline changes nothing: the deadline closes the group first)."""
        kind, seq = op.kind, op.seq
        own_due = math.inf
        # Closed since this collective was issued: by a member's death, whatever the time; by another collective's
        # failure, unless this one's own deadline has passed too (then it timed out, below).
        if not op.done.triggered and self.broken is not None and (self._gone is not None or not op.deadline.processed):
            raise self._closed_error(f"{kind} #{seq}")
        if not op.done.triggered:
            env = self.kernel.env
            waits = [op.done, op.deadline, self._closed_event()]
            if timeout_s is not None and env.now + timeout_s < op.deadline_at:
                own_due = env.now + timeout_s
                waits.append(env.timeout(timeout_s))
            self._wait_any(waits, f"{kind} #{seq} on group {self.name}")
            # This rank's own bound is up when its time has come, whichever event of that instant woke it first.
            own_up = env.now >= own_due
            if not op.done.triggered and not (op.deadline.processed or own_up) and self.broken is not None:
                # Another rank's collective on this group failed: gloo closed the pairs, and this wait ends too.
                raise self._closed_error(f"{kind} #{seq}")
            if not op.done.triggered and len(op.args) == len(self.pids) and not own_up:
                self.kernel.wait(op.done, f"{kind} #{seq} on group {self.name}")  # everyone came: only the latency
        if not op.done.triggered:
            missing = [r for r in range(len(self.pids)) if r not in op.args]
            pids = [self.pids[r] for r in missing]
            if not op.deadline.processed:  # this wait's own bound, not the group's timeout
                self.kernel.history.record(
                    "collective.wait_timeout", group=self.name, op=kind, seq=seq, pid=self.pids[rank], missing=pids
                )
                lag = f"ranks {missing} (pids {pids}) had not arrived" if missing else "the result had not landed"
                raise CollectiveTimeout(
                    f"Operation timed out! ({kind} #{seq} on group {self.name}: {lag} after "
                    f"Work.wait's {timeout_s:g} s)",
                    missing,
                )
            self.kernel.history.record(
                "collective.timeout", group=self.name, op=kind, seq=seq, pid=self.pids[rank], missing=pids
            )
            self._close(f"collective #{seq} timed out on rank {rank}")
            raise CollectiveTimeout(
                f"{kind} #{seq} on group {self.name} timed out after {self.timeout_s:g} s: ranks "
                f"{missing} (pids {pids}) never arrived",
                missing,
            )
        if op.error is not None:
            who, exc = op.error
            if who == rank:
                raise exc
            raise RuntimeError(
                f"{kind} #{seq} on group {self.name}: connection closed by peer (rank {who}: "
                f"{type(exc).__name__}: {exc})"
            )
        results = op.done.value
        return results[rank] if private else _copy(results[rank], op.copiers)

    def _wait_any(self, events: list, what: str) -> None:
        """Wait until one of ``events`` fires: what ``kernel.wait(env.any_of(events))`` does, event for event and
        tie-break draw for draw (one wake-up event, triggered by the first of them to be processed, or at once if
        one already was), without a SimPy condition and its value per waiting rank: every rank of every
        collective waits here."""
        wake = self.kernel.env.event()

        def check(event: Any) -> None:
            if not wake.triggered:
                if event._ok:
                    wake.succeed()
                else:  # as a condition does: the failure is delivered to the waiter, not left to crash the loop
                    event._defused = True
                    wake.fail(event._value)

        pending = []
        for event in events:
            if event.callbacks is None:  # already processed
                check(event)
            else:
                event.callbacks.append(check)
                pending.append(event)
        self.kernel.wait(wake, what)
        for event in pending:  # as a condition does once it fires: the others no longer hold the check
            callbacks = event.callbacks
            if callbacks:
                with contextlib.suppress(ValueError):
                    callbacks.remove(check)


_live: "weakref.WeakKeyDictionary[Any, list[weakref.ref[Rendezvous]]]" = weakref.WeakKeyDictionary()  # per kernel,
# in order of creation, so that groups close in the same order in every run


def process_gone(kernel, pid: int, why: str = "exited") -> None:
    """Process ``pid`` ended: its connections closed, so every group it was a member of closes (a destroyed one is
    left alone: nothing runs on it again).  The others' waits end and their later calls fail at once, as on gloo,
    where a peer's death fails every member's collective within milliseconds instead of at the group's timeout."""
    refs = _live.get(kernel, [])
    refs[:] = [ref for ref in refs if ref() is not None]
    for ref in refs:
        rdv = ref()
        if rdv is not None and pid in rdv.pids and not rdv.destroyed:
            rdv._close(f"pid {pid} {why}", gone=pid)


class FakeProcessGroup:
    """One rank's handle on a group: ``rank()`` and ``size()`` as on a torch ProcessGroup."""

    def __init__(self, rdv: Rendezvous, rank: int) -> None:
        self._rdv, self._rank = rdv, rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self._rdv.pids)

    @property
    def group_name(self) -> str:
        return self._rdv.name

    @property
    def rendezvous(self) -> Rendezvous:
        return self._rdv

    def __repr__(self) -> str:
        return f"<FakeProcessGroup {self._rdv.name} rank {self._rank}/{self.size()}>"


class _Work:
    """What ``async_op=True`` returns: the collective is issued at the call and completes on its own; ``wait``
    waits for it (``timeout``, as a ``timedelta`` or seconds, bounds that wait) and raises what it raised."""

    def __init__(self, g: FakeProcessGroup, op: _Op, private: bool, then: Callable[[Any], Any] | None = None) -> None:
        self._g, self._op, self._private, self._then = g, op, private, then
        self._waited = False

    def wait(self, timeout=None) -> bool:
        if not self._waited:
            limit = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
            # torch hands gloo whole milliseconds, and gloo takes zero for no bound; a negative bound is up at once.
            # A wait that timed out leaves _waited False: a later one may still finish.
            ms = None if limit is None else int(float(limit) * 1000)
            result = self._g.rendezvous.finish(
                self._op, self._g.rank(), self._private, None if not ms else max(ms, 0) / 1000
            )
            self._waited = True
            if self._then is not None:
                self._then(result)
        return True

    def is_completed(self) -> bool:
        return self._op.done.triggered

    def is_success(self) -> bool:
        return self._op.done.triggered and self._op.error is None


def _group(group) -> FakeProcessGroup:
    if not isinstance(group, FakeProcessGroup):
        raise TypeError("fake torch.distributed needs an explicit fake group (group=...)")
    return group


# -- the torch.distributed surface -------------------------------------------------------------------------
def get_rank(group=None) -> int:
    g = _group(group)
    raise ValueError(f"Group {g!r} is not registered, please create group with torch.distributed.new_group API")


def get_world_size(group=None) -> int:
    return _group(group).size()


def all_gather_object(object_list: list, obj: Any, group=None) -> None:
    g = _group(group)
    gathered = g.rendezvous.run(g.rank(), "all_gather_object", obj, lambda objs: [objs] * len(objs))
    for i, value in enumerate(gathered):  # as torch fills it: a list shorter than the group raises IndexError
        object_list[i] = value


def broadcast_object_list(
    object_list: list, src: int | None = None, group=None, device=None, group_src: int | None = None
) -> None:
    g = _group(group)
    if src is not None and group_src is not None:
        raise ValueError("Can't specify both group_rank and global_rank")
    if group_src is None:  # src (default 0) is a global rank, which a stateless group has no map for
        raise ValueError(
            f"Process group {g!r} is not initialized in the world group map. Please initialize the group first."
        )
    if not 0 <= group_src < g.size():
        raise ValueError(f"Group rank {group_src} is not part of group {g!r}")
    root = group_src

    def pick(contributions):
        roots = {r for r, _ in contributions}
        sizes = {len(objs) for _, objs in contributions}
        if len(roots) > 1 or len(sizes) > 1:
            raise CollectiveMismatch(
                f"broadcast_object_list on group {g.group_name}: ranks gave sources "
                f"{sorted(roots)} and list lengths {sorted(sizes)}"
            )
        return [contributions[root][1]] * len(contributions)

    result = g.rendezvous.run(g.rank(), "broadcast_object_list", (root, list(object_list)), pick)
    if g.rank() != root:  # the source keeps its own objects
        for i, value in enumerate(result):
            object_list[i] = value


def barrier(group=None, async_op: bool = False, device_ids=None):
    g = _group(group)
    work = _Work(g, g.rendezvous.arrive(g.rank(), "barrier", None, lambda objs: [None] * len(objs)), True)
    if async_op:
        return work
    work.wait()
    return None


def _reduce_op_name(op) -> str:
    if op is None:
        return "SUM"
    if isinstance(op, str):
        raise TypeError(f"all_reduce(): op must be a torch.distributed.ReduceOp, not {op!r}")
    name = (getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]).upper()
    if name not in ReduceOps:
        raise ValueError(f"all_reduce op {op!r} not supported by the fake; use one of {ReduceOps}")
    return name


def all_reduce(tensor, op=None, group=None, async_op: bool = False):
    import torch

    g = _group(group)
    name = _reduce_op_name(op)
    integral = not (tensor.is_floating_point() or tensor.is_complex())
    if name in _BITWISE and not integral:
        raise RuntimeError(f"Cannot use ReduceOp.{name} with non-integral dtype")
    if name == "AVG" and integral:
        dtype = {
            torch.int64: "Long",
            torch.int32: "Int",
            torch.int16: "Short",
            torch.int8: "Char",
            torch.uint8: "Byte",
            torch.bool: "Bool",
        }.get(tensor.dtype, str(tensor.dtype))
        raise RuntimeError(f"result type Float can't be cast to the desired output type {dtype}")

    def reduce(values):
        first = values[0]
        if any(v.dtype != first.dtype or v.shape != first.shape for v in values):
            raise RuntimeError(
                f"all_reduce on group {g.group_name}: ranks gave tensors of different shapes or "
                f"dtypes ({sorted({(tuple(v.shape), str(v.dtype)) for v in values})}): gloo "
                "receives a different data size than it expects"
            )
        if name in _BITWISE:
            fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[name]
            out = values[0].clone()
            for v in values[1:]:
                out = fn(out, v)
            return [out] * len(values)
        stacked = torch.stack(values)
        out = {
            "SUM": lambda s: s.sum(0),
            "MAX": lambda s: s.max(0).values,
            "MIN": lambda s: s.min(0).values,
            "PRODUCT": lambda s: s.prod(0),
            "AVG": lambda s: s.sum(0) / len(values),
        }[name](stacked)
        return [out] * len(values)

    op_ = g.rendezvous.arrive(g.rank(), f"all_reduce[{name}]", tensor.detach().cpu(), reduce)
    # The result lands in the rank's tensor once, when the collective completes, waited for or not (as gloo's
    # does); whichever comes first, the completion or the caller's wait, copies it (cast to the tensor's dtype), so
    # the other never overwrites what the caller wrote since.
    rank = g.rank()
    landed: list[bool] = []

    def land(result) -> None:
        if not landed:
            landed.append(True)
            tensor.copy_(result)

    def on_done(ev) -> None:
        if ev.value is not None:
            land(ev.value[rank])

    op_.done.callbacks.append(on_done)
    work = _Work(g, op_, True, land)
    if async_op:
        return work
    work.wait()
    return None


_FUNCTIONS = ("get_rank", "get_world_size", "all_gather_object", "broadcast_object_list", "barrier", "all_reduce")


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Route ``torch.distributed`` calls whose group is fake to this module; restore afterwards."""
    import torch.distributed as dist

    saved = {name: getattr(dist, name) for name in _FUNCTIONS}

    def dispatcher(name):
        real, fake = saved[name], globals()[name]

        def call(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, FakeProcessGroup)), None)
            return fake(*args, **kwargs) if isinstance(group, FakeProcessGroup) else real(*args, **kwargs)

        call.__name__ = name
        call.__wrapped__ = real  # type: ignore[attr-defined]  # what it dispatches to off the fake groups
        return call

    for name in _FUNCTIONS:
        setattr(dist, name, dispatcher(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
