"""The registration ledger of a real rank: every NIXL agent call that the oracles judge, recorded as it happens.

The strategies import ``nixl_agent`` from ``nixl._api``; in a rank process :func:`install` replaces that name with
:class:`LedgerAgent`, which builds the real agent and forwards every call to it, recording agent creation and
destruction, registrations, peers loaded and removed, and every transfer (its local and remote byte ranges) in the
vocabulary of the fake NIXL's fabric events, so :class:`sim.oracles.Oracles` judges both worlds alike.  The ledger
comes from the calls the library actually received, not from what a strategy believes it did.

``restart()`` is the one thing the ledger adds: the real agent is destroyed and a new one made under the same name
with the same memory registered again (the ``peer.restart`` fault, done for real).
"""

from __future__ import annotations

import gc
import itertools
import os
import sys
import threading
import types
import weakref
from typing import Any, Callable

Emit = Callable[..., None]  # emit(kind, **fields)

_serial = itertools.count()


def _name(value: Any) -> str:
    """An agent name as NIXL reads it: bytes (what add_remote_agent returns, which clients pass on) or a bytearray
    are the decoded str name.  The ledger records a call after NIXL accepted it, so no other type reaches here."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "surrogateescape")
    return str(value)


def _spans(dlist: Any) -> list[tuple[int, int]]:
    """(address, length) of every descriptor of a real nixlRegDList / nixlXferDList (they do not iterate)."""
    return [(int(d[0]), int(d[1])) for d in (dlist[i] for i in range(dlist.descCount()))]


class LedgerAgent:
    """A real ``nixl_agent`` whose calls are recorded; anything not recorded is forwarded unchanged."""

    _real: Any = None  # the real nixl_agent class, set by install()
    _emit: Emit = staticmethod(lambda kind, **fields: None)
    _pid: int = -1
    _live: "weakref.WeakSet[LedgerAgent]" = weakref.WeakSet()

    def __init__(self, agent_name: str | bytes, nixl_conf: Any = None, instantiate_all: bool = False) -> None:
        self._given, self._conf, self._all = agent_name, nixl_conf, instantiate_all
        self._name = _name(agent_name)  # the name the ledger records
        self._registered: list[tuple[Any, Any]] = []  # (descs, mem type) still registered, for restart()
        self._dlists: dict[int, tuple[str, list[tuple[int, int]]]] = {}  # id(handle) -> (agent name, spans)
        self._xfers: dict[int, tuple[str, str, list[tuple[int, int]], list[tuple[int, int]]]] = {}
        self._open: dict[int, str] = {}  # id(xfer) posted and not yet done -> thread name
        self._raced = False  # reported a racing thread already (once per agent: the first race is the finding)
        self._inner: Any = None  # the real nixl_agent, made in start(); None after it is dropped
        self._start()
        self._live.add(self)

    # -- the real agent, and its replacement under the same name --------------------------------------------------
    def _start(self) -> None:
        self.conn = f"{self._pid}/{next(_serial)}"
        args = (self._given, self._conf) if self._conf is not None else (self._given,)
        self._inner = type(self)._real(*args, instantiate_all=self._all) if self._all else type(self)._real(*args)
        self._emit("agent.create", conn=self.conn, agent=self._name, pid=self._pid)

    def restart(self) -> None:
        """Destroy the real agent and make a new one under the same name, registering the same memory again: what
        a peer sees when a process restarts with the same agent name."""
        registered = list(self._registered)
        self._drop_inner()
        self._registered, self._dlists, self._xfers, self._open = [], {}, {}, {}
        self._start()
        for descs, mem in registered:
            self.register_memory(descs, mem)

    def _drop_inner(self) -> None:
        inner, self._inner = self._inner, None
        if inner is not None:
            self._emit("agent.destroy", conn=self.conn, agent=self._name, pid=self._pid)
            del inner  # the C++ agent lives on only while a transfer handle holds it (as in NIXL itself)

    def __del__(self) -> None:
        if getattr(self, "_inner", None) is not None:
            self._drop_inner()

    @property
    def name(self) -> Any:
        return self._given  # as nixl_agent.name: what the caller gave

    def __getattr__(self, attr: str) -> Any:
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(attr)
        value = getattr(inner, attr)
        if not callable(value) or attr in _NO_AGENT_CALL:
            return value

        def call(*args: Any, **kw: Any) -> Any:  # an agent call like any other (get_agent_metadata, ...)
            self._note_thread()
            return value(*args, **kw)

        return call

    # -- memory -------------------------------------------------------------------------------------------------
    def _as_reg(self, descs: Any, mem_type: Any) -> Any:
        return descs if hasattr(descs, "descCount") else self._inner.get_reg_descs(descs, mem_type)

    def register_memory(self, reg_list: Any, mem_type: Any = None, backends: Any = ()) -> Any:
        self._note_thread()
        descs = self._as_reg(reg_list, mem_type)
        out = (
            self._inner.register_memory(descs, mem_type, list(backends))
            if backends
            else self._inner.register_memory(descs, mem_type)
        )
        self._registered.append((descs, mem_type))
        self._emit("register", conn=self.conn, agent=self._name, pid=self._pid, ranges=_spans(descs))
        return out

    def deregister_memory(self, dereg_list: Any, backends: Any = ()) -> None:
        self._note_thread()
        descs = self._as_reg(dereg_list, None)
        spans = _spans(descs)
        try:
            if backends:
                self._inner.deregister_memory(descs, list(backends))
            else:
                self._inner.deregister_memory(descs)
        except Exception:
            # NIXL refused it (nothing of it registered): the judge tells a second release of one range from others
            self._emit("deregister.refused", conn=self.conn, agent=self._name, pid=self._pid, ranges=spans)
            raise
        self._registered = [(d, m) for d, m in self._registered if _spans(d) != spans]
        self._emit("deregister", conn=self.conn, agent=self._name, pid=self._pid, ranges=spans)

    # -- peers --------------------------------------------------------------------------------------------------
    def add_remote_agent(self, metadata: bytes) -> Any:
        self._note_thread()
        name = self._inner.add_remote_agent(metadata)
        self._emit("peer.load", conn=self.conn, agent=self._name, pid=self._pid, peer=_name(name))
        return name

    def remove_remote_agent(self, agent: str) -> None:
        self._note_thread()
        self._inner.remove_remote_agent(agent)
        self._emit("peer.remove", conn=self.conn, agent=self._name, pid=self._pid, peer=_name(agent))

    # -- transfers ----------------------------------------------------------------------------------------------
    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: Any = None, *args: Any, **kw: Any) -> Any:
        self._note_thread()
        handle = self._inner.prep_xfer_dlist(agent_name, xfer_list, mem_type, *args, **kw)
        descs = xfer_list if hasattr(xfer_list, "descCount") else self._inner.get_xfer_descs(xfer_list, mem_type)
        # nixl._api makes "NIXL_INIT_AGENT" and "" local; bytes reach the library as a name, where b"" is local
        target = _name(agent_name)
        if target == "" or agent_name == "NIXL_INIT_AGENT":
            target = self._name
        self._dlists[id(handle)] = (target, _spans(descs))
        return handle

    def release_dlist_handle(self, handle: Any) -> None:
        self._note_thread()
        self._dlists.pop(id(handle), None)
        self._inner.release_dlist_handle(handle)

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: Any,
        local_indices: Any,
        remote_xfer_side: Any,
        remote_indices: Any,
        *args: Any,
        **kw: Any,
    ) -> Any:
        self._note_thread()
        handle = self._inner.make_prepped_xfer(
            operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices, *args, **kw
        )
        _, local = self._dlists.get(id(local_xfer_side), ("", []))
        target, remote = self._dlists.get(id(remote_xfer_side), ("", []))
        self._xfers[id(handle)] = (
            str(operation),
            target,
            [local[int(i)] for i in local_indices],
            [remote[int(i)] for i in remote_indices],
        )
        return handle

    def initialize_xfer(
        self, operation: str, local_descs: Any, remote_descs: Any, remote_agent: str, *args: Any, **kw: Any
    ) -> Any:
        self._note_thread()
        handle = self._inner.initialize_xfer(operation, local_descs, remote_descs, remote_agent, *args, **kw)
        self._xfers[id(handle)] = (str(operation), _name(remote_agent), _spans(local_descs), _spans(remote_descs))
        return handle

    def transfer(self, handle: Any, *args: Any, **kw: Any) -> str:
        self._note_thread()
        state = self._inner.transfer(handle, *args, **kw)
        xfer = self._xfers.get(id(handle))
        if xfer is not None:
            op, target, _, remote = xfer
            self._emit(
                "xfer.post",
                conn=self.conn,
                agent=self._name,
                pid=self._pid,
                peer=target,
                op=op,
                nbytes=sum(n for _, n in remote),
            )
            self._open[id(handle)] = threading.current_thread().name
        if state == "DONE":
            self._done(handle)
        return state

    def check_xfer_state(self, handle: Any) -> str:
        self._note_thread()
        state = self._inner.check_xfer_state(handle)
        if state == "DONE" and id(handle) in self._open:
            self._done(handle)
        return state

    def release_xfer_handle(self, handle: Any, *args: Any, **kw: Any) -> None:
        self._note_thread()
        self._open.pop(id(handle), None)
        self._xfers.pop(id(handle), None)
        self._inner.release_xfer_handle(handle, *args, **kw)

    def _done(self, handle: Any) -> None:
        self._open.pop(id(handle), None)
        xfer = self._xfers.get(id(handle))
        if xfer is None:
            return
        op, target, local, remote = xfer
        self._emit(
            "xfer.done",
            conn=self.conn,
            agent=self._name,
            pid=self._pid,
            peer=target,
            op=op,
            local=local,
            remote=remote,
            nbytes=sum(n for _, n in remote),
        )

    def _note_thread(self) -> None:
        """NIXL 1.5.1 agents run without thread safety: another thread's call while requests are open races.  Every
        call into the agent checks it, as the fake's does, not only transfer and check_xfer_state: a finalizer
        deregistering on another thread must not go unseen."""
        if self._raced:
            return
        me = threading.current_thread().name
        holders = list(self._open.values())  # a snapshot: the other thread may complete requests meanwhile
        others = sorted({t for t in holders if t != me})
        if others:
            self._raced = True
            self._emit(
                "agent.threads",
                conn=self.conn,
                agent=self._name,
                pid=self._pid,
                thread=me,
                others=others,
                open=sum(1 for t in holders if t != me),
            )


# Helpers that build descriptor lists in Python and make no call into the agent (the fake's bindings see none).
_NO_AGENT_CALL = frozenset({"get_reg_descs", "get_xfer_descs"})


def live_agents() -> list[LedgerAgent]:
    """This process's agents that are still alive, oldest first."""
    return sorted((a for a in LedgerAgent._live if a._inner is not None), key=lambda a: int(a.conn.split("/")[1]))


def agents_held_only_by(roots: list[Any]) -> set[int]:
    """``id`` of every live agent that ``roots`` hold and nothing else does: what would die if the roots were let go
    (the simulation finalizes gc.never's objects before its leak check; a real process does that at its exit, too
    late to report).  Reachability follows containers and instance attributes, not classes, modules or functions:
    through a function's globals everything is reachable."""
    agents = {id(a): a for a in live_agents()}
    seen: set[int] = set()
    found = []
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _NOT_FOLLOWED):
            continue
        seen.add(id(obj))
        if id(obj) in agents:
            found.append(obj)
            continue
        todo.extend(gc.get_referents(obj))
    mine = {id(todo), id(found), id(agents)}  # this function's own lists refer to the agents too
    return {
        id(a)
        for a in found
        if all(id(r) in seen or id(r) in mine or isinstance(r, types.FrameType) for r in gc.get_referrers(a))
    }


_NOT_FOLLOWED = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.FrameType,
    types.CodeType,
)


def install(emit: Emit, pid: int) -> None:
    """Make ``nixl._api.nixl_agent`` a :class:`LedgerAgent` in this process (the real NIXL behind it), so that
    ``from nixl._api import nixl_agent`` in a strategy gets it."""
    from .nixl_real import apply_progress_delay, import_real_nixl

    api, bindings, package = import_real_nixl()
    # The poll timeout changes how the rank's NIXL behaves (a spinning or a sleeping progress thread): the run's
    # result says which one each rank had (real_backends/run.py).
    emit("nixl.config", pid=pid, package=package, progress_delay_us=apply_progress_delay(bindings))
    if package != "nixl":  # no meta package: let `nixl._api` name the variant that is installed, as the meta does
        import importlib

        sys.modules.setdefault("nixl", importlib.import_module(package))
        sys.modules.setdefault("nixl._api", api)
    LedgerAgent._real = api.nixl_agent
    LedgerAgent._emit = staticmethod(emit)
    LedgerAgent._pid = pid
    api.nixl_agent = LedgerAgent
    vars(sys.modules["nixl._api"])["nixl_agent"] = LedgerAgent
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
