"""Fake ``torch.distributed`` process groups that run inside the simulation kernel.

Each simulated rank holds its own :class:`FakeProcessGroup` (as each real process holds its own ProcessGroup); the
members of one group share a :class:`Rendezvous`.  Collectives match by sequence number: the k-th collective a rank
issues on a group meets the k-th of every other member.  Objects cross "processes" as copies (tensors cloned, lists
and dicts rebuilt around shared immutable leaves, anything else pickled), so no simulated rank ever aliases another's
mutable objects.  A collective that some member never reaches raises :class:`CollectiveTimeout` once the group's
timeout has passed since its first member arrived (vLLM's EPLB barrier waits 5 minutes), naming the missing ranks.

``with installed():`` makes ``torch.distributed.all_gather_object`` and friends dispatch to these fakes when the
``group`` argument is a fake group, and to the real functions otherwise, so code written against
``torch.distributed`` runs unmodified.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

ReduceOps = ("SUM", "MAX", "MIN", "PRODUCT", "AVG")


class CollectiveTimeout(RuntimeError):
    """A collective that not every member reached in time (a liveness failure, not a hang)."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


class CollectiveMismatch(RuntimeError):
    """Members issued different collectives at the same position (real backends hang or corrupt data here)."""


@dataclass
class _Op:
    kind: str
    seq: int
    args: dict[int, Any] = field(default_factory=dict)  # group rank -> contribution
    done: Any = None  # simpy event, value = result per rank
    deadline: Any = None  # simpy timeout from the first arrival: one watchdog per collective, not per waiter
    copiers: dict = field(default_factory=dict)  # id(result) -> a function copying it, while the results live


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
            parts = [build(x) for x in v]
            return None if None in parts else (lambda: [p() for p in parts])
        if not all(map(_shareable, v)):  # keys
            return None
        if all(map(_shareable, v.values())):
            return v.copy
        parts = [(k, build(x)) for k, x in v.items()]
        return None if any(p is None for _, p in parts) else (lambda: {k: p() for k, p in parts})

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

    def __init__(self, kernel, name: str, pids: list[int], timeout_s: float = 300.0, latency_s: float = 0.0) -> None:
        self.kernel, self.name, self.pids, self.timeout_s = kernel, name, list(pids), timeout_s
        self.latency_s = latency_s  # from the last arrival to the result (a calibration measures gloo's)
        self._ops: dict[int, _Op] = {}
        self._next_seq = [0] * len(pids)
        self.destroyed = False

    def groups(self) -> list["FakeProcessGroup"]:
        return [FakeProcessGroup(self, r) for r in range(len(self.pids))]

    def run(self, rank: int, kind: str, contribution: Any, combine, private: bool = False) -> Any:
        """Issue this rank's collective ``kind`` and wait for its result.  ``private``: the caller only reads the
        result (all_reduce copies it into the rank's own tensor), so it is not copied for each rank."""
        if self.destroyed:
            raise RuntimeError(f"{kind} on destroyed group {self.name}")
        seq = self._next_seq[rank]
        self._next_seq[rank] += 1
        op = self._ops.get(seq)
        if op is None:
            env = self.kernel.env
            op = self._ops[seq] = _Op(kind, seq, done=env.event(), deadline=env.timeout(self.timeout_s))
        elif op.kind != kind:
            raise CollectiveMismatch(f"collective #{seq} on group {self.name}: rank {rank} issued {kind}, "
                                     f"others {op.kind}")
        op.args[rank] = _copy(contribution)
        self.kernel.history.record("collective.arrive", group=self.name, op=kind, seq=seq,
                                   pid=self.pids[rank], rank=rank)
        if len(op.args) == len(self.pids):
            results = combine([op.args[r] for r in range(len(self.pids))])
            del self._ops[seq]
            if self.latency_s > 0:
                self.kernel.env.timeout(self.latency_s).callbacks.append(
                    lambda _, done=op.done, results=results: done.succeed(results))
            else:
                op.done.succeed(results)
        if not op.done.triggered:
            self.kernel.wait(self.kernel.env.any_of([op.done, op.deadline]), f"{kind} #{seq} on group {self.name}")
            if not op.done.triggered and len(op.args) == len(self.pids):  # everyone came: only the latency is left
                self.kernel.wait(op.done, f"{kind} #{seq} on group {self.name}")
        ok = op.done.triggered
        results = op.done.value if ok else None
        if not ok:
            missing = [r for r in range(len(self.pids)) if r not in op.args]
            self.kernel.history.record("collective.timeout", group=self.name, op=kind, seq=seq, pid=self.pids[rank],
                                       missing=[self.pids[r] for r in missing])
            raise CollectiveTimeout(
                f"{kind} #{seq} on group {self.name} timed out after {self.timeout_s:g} s: ranks "
                f"{missing} (pids {[self.pids[r] for r in missing]}) never arrived", missing)
        return results[rank] if private else _copy(results[rank], op.copiers)


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
    def __init__(self, fn) -> None:
        self._fn, self._done = fn, False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._fn()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def _group(group) -> FakeProcessGroup:
    if not isinstance(group, FakeProcessGroup):
        raise TypeError("fake torch.distributed needs an explicit fake group (group=...)")
    return group


# -- the torch.distributed surface -------------------------------------------------------------------------
def get_rank(group=None) -> int:
    return _group(group).rank()


def get_world_size(group=None) -> int:
    return _group(group).size()


def all_gather_object(object_list: list, obj: Any, group=None) -> None:
    g = _group(group)
    gathered = g.rendezvous.run(g.rank(), "all_gather_object", obj, lambda objs: [objs] * len(objs))
    object_list[:] = gathered


def broadcast_object_list(object_list: list, src: int | None = None, group=None, device=None,
                          group_src: int | None = None) -> None:
    g = _group(group)
    root = group_src if group_src is not None else (src if src is not None else 0)
    if src is not None and group_src is None:
        root = g.rendezvous.pids.index(src) if src in g.rendezvous.pids else src
    result = g.rendezvous.run(g.rank(), "broadcast_object_list", list(object_list),
                              lambda objs: [objs[root]] * len(objs))
    object_list[:] = result


def barrier(group=None, async_op: bool = False, device_ids=None):
    g = _group(group)
    work = _Work(lambda: g.rendezvous.run(g.rank(), "barrier", None, lambda objs: [None] * len(objs)))
    if async_op:
        return work
    work.wait()
    return None


def all_reduce(tensor, op=None, group=None, async_op: bool = False):
    g = _group(group)
    name = getattr(op, "name", None) or (str(op).rsplit(".", 1)[-1] if op is not None else "SUM")
    name = name.upper()
    if name not in ReduceOps:
        raise ValueError(f"all_reduce op {op!r} not supported by the fake; use one of {ReduceOps}")

    def reduce(values):
        import torch

        stacked = torch.stack(values)
        out = {"SUM": lambda s: s.sum(0), "MAX": lambda s: s.max(0).values, "MIN": lambda s: s.min(0).values,
               "PRODUCT": lambda s: s.prod(0), "AVG": lambda s: s.sum(0) / len(values)}[name](stacked)
        return [out] * len(values)

    def go():
        result = g.rendezvous.run(g.rank(), f"all_reduce[{name}]", tensor.detach().cpu(), reduce, private=True)
        tensor.copy_(result)  # casts to the tensor's dtype, as the real all_reduce leaves it

    work = _Work(go)
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
        call.__wrapped__ = real
        return call

    for name in _FUNCTIONS:
        setattr(dist, name, dispatcher(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
