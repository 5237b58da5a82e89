"""Transfers: descriptor-list preparation, requests, posting, state checks and release.

Facts reproduced (docs/reference/nixl-1.5.1.md, facts 4, 17-27): checks happen when a request is created, never at post;
a request made from prepared lists that were released later still posts; state is only DONE or PROC and every error
raises; DONE is sticky and a DONE request can be reposted; reposting one in flight is REPOST_ACTIVE; a request towards a
peer that was removed (or removed and added again) is NOT_FOUND; deregistration does not stop a transfer on cma/NVLink;
a request released in flight still lands; a notification is sent by the check that finds its request complete. Where
1.5.1 crashes the process (posting a released request), the ``dram`` profile raises :class:`SimulatedCrash`."""

from __future__ import annotations

import time

from ctypes import memmove  # the bytes of a transfer move for real, host to host
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from . import _status as S
from ._parts import AgentParts
from ._dlist import nixlXferDList
from ._faults import STATUS_BY_NAME
from ._memory import Region

NEW, PROC, DONE, ERR = "NEW", "PROC", "DONE", "ERR"
_OPS = {0: "READ", 1: "WRITE"}


@dataclass(slots=True)
class PreppedDlist:
    handle: int
    side: str  # "local", "remote" (a peer) or "loopback"
    peer: str | None
    generation: int | None
    mem: int
    triples: tuple[tuple[int, int, int], ...]
    regions: tuple[Region, ...]  # shared with the range index's answer: never changed


@dataclass(slots=True)
class XferReq:
    handle: int
    op: str
    peer: str  # remote agent name; our own name for loopback
    generation: int | None  # the peer entry this request was made against
    pairs: list[tuple[int, int, int]]  # (local addr, remote addr, length)
    local_regions: Sequence[Region]  # a prepared list's own tuple when the request takes it whole
    remote_regions: Sequence[Region]
    notif: bytes = b""
    state: str = NEW
    error: int = 0
    polls: int = 0
    epoch: int = 0
    released: bool = False
    fail_after: Any = None
    finished: bool = False  # the bytes have moved; the state reads DONE once a check has seen it
    due: float = 0.0  # when the bytes will have moved (inf: never)
    nbytes: int = field(init=False, default=0)
    owner: Any = field(init=False, default=None)  # the simulated thread that made it (inside the simulator)
    # Telemetry (agents that keep it): the last post's start and end, and when a check first saw it DONE, in seconds
    # of the telemetry clock.
    posted: tuple[float, float] | None = field(init=False, default=None)
    done_at: float | None = field(init=False, default=None)
    _spans: tuple | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.nbytes = sum([p[2] for p in self.pairs])  # the descriptors never change after the request is made

    @property
    def spans(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """((local addr, len), ...) and ((remote addr, len), ...): what listeners read of the descriptors, made on
        first use (a transfer's completion; its post needs none)."""
        spans = self._spans
        if spans is None:
            pairs = self.pairs
            spans = self._spans = (tuple([(la, n) for la, _, n in pairs]), tuple([(ra, n) for _, ra, n in pairs]))
        return spans


# What a released request handle resolves to: every use of it is refused (or crashes) before its content is read.
_RELEASED = XferReq(0, "READ", "", None, [], [], [], released=True, state=DONE)


@dataclass
class nixlXferTelemetry:
    startTime: int = 0
    postDuration: int = 0
    xferDuration: int = 0
    totalBytes: int = 0
    descCount: int = 0


def _handle_value(fabric) -> int:
    # Real handles are heap pointers; the fake's look alike but are deterministic.
    return 0x7F00_0000_0000 + next(fabric._ids) * 0x40


_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1  # pybind casts the indices to C++ ints
_IN_ORDER: dict[int, list[int]] = {}
_LOOKUP = object()  # "look the peer up": None is an answer (not a peer)


def _in_order(n: int) -> list[int]:
    """``list(range(n))``, made once per n: the indices of a request that takes two whole lists in order."""
    found = _IN_ORDER.get(n)
    if found is None:
        found = _IN_ORDER[n] = list(range(n))
    return found


_INT_TYPE = frozenset({int})


def _cast_error(values: Any) -> None:
    raise RuntimeError(
        f"Unable to cast Python instance of type {type(values)} to C++ type '?' (#define "
        "PYBIND11_DETAILED_ERROR_MESSAGES or compile in debug mode for details)"
    )


def _indices(values: Any) -> list[int]:
    """The indices as 1.5.1 takes them: a 1-D numpy array of any number type (cast), or a sequence of integers; a
    tensor, floats or None do not cast (RuntimeError), nor does a value outside a C++ int (makeXferReq's range
    check finds those)."""
    if type(values) is list and {*map(type, values)} <= _INT_TYPE:  # every EPLB READ: read, never changed
        return values
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError("indices numpy array must be 1D")
        return [int(v) for v in values.tolist()]
    if values is None or type(values).__module__.startswith("torch"):
        _cast_error(values)
    items = list(values)
    if any(isinstance(v, float) or not hasattr(v, "__index__") for v in items):
        _cast_error(values)
    return [int(v) for v in items]


class XferMixin(AgentParts):
    def _init_xfer(self) -> None:
        self.dlists: dict[int, PreppedDlist] = {}
        self.xfers: dict[int, XferReq] = {}
        # Released handles are remembered (their use is an error, or a crash as in 1.5.1) but not their content:
        # an EPLB rebalance at EP64 makes tens of thousands of requests, and keeping each one after its release
        # grew the heap (and every planned gc.collect()) without bound.
        self.released_handles: set[int] = set()
        self.req_owners: dict[Any, int] = {}  # simulated thread -> requests it made that are not released yet

    # -- where the remote side lives ------------------------------------------------------------------------
    def _remote_side(self, agent_name: str, call: str):
        """(side, peer, generation, region lookup) for a remote or loopback name."""
        if agent_name == self.name:
            return "loopback", None, self._loopback_region
        peer = self.peers.get(agent_name)
        if peer is None:
            S.fail(S.NOT_FOUND, f"{call}: metadata for remote agent '{agent_name}' not found")
        return "remote", peer, peer.covers

    def _regions_of(self, agent_name: str, mem: int, triples: tuple[tuple[int, int, int], ...], call: str):
        """(side, peer, the Region covering each descriptor, None where nothing does) of a descriptor list
        prepared towards ``agent_name``: our own registrations for NIXL_INIT_AGENT, else as :meth:`_remote_side`
        looks them up."""
        if agent_name in ("", S.NIXL_INIT_AGENT):
            return "local", None, self.region_index.find_each(mem, triples)
        side, peer, _ = self._remote_side(agent_name, call)
        if peer is None:  # loopback
            return side, None, self.region_index.find_each(mem, triples, self.loopback_hidden or None)
        return side, peer, peer.table.index.find_each(mem, triples)

    def _no_registration(self, call: str) -> None:
        S.fail(
            S.NOT_FOUND,
            f"{call}: no specified or potential backend had the required registrations to be able to do the transfer",
        )

    # -- preparation ----------------------------------------------------------------------------------------
    def prepXferDlist(self, agent_name: str, descs: Any, *rest: Any) -> int:
        self._enter()
        if type(descs) is nixlXferDList:  # every EPLB READ, twice
            triples, mem = tuple(descs._descs), int(descs._type)
        elif isinstance(descs, S.nixl_mem_t):  # strided overload: (name, mem, Nx5 array, backends)
            mem, rows = int(descs), rest[0]
            triples = tuple(
                (int(a) + i * int(st), int(n), int(d)) for a, n, d, st, c in rows.tolist() for i in range(int(c))
            )
        else:
            triples = tuple(self._xfer_triples(descs, "prepXferDlist"))
            mem = int(descs.getType())
        if not triples:
            S.fail(S.NOT_FOUND, "prepXferDlist: empty descriptor list: no backend can prepare it")
        side, peer, regions = self._regions_of(agent_name, mem, triples, "prepXferDlist")
        for region in regions:
            if region is None:
                self._no_registration("prepXferDlist")
        handle = _handle_value(self.fabric)
        self.dlists[handle] = PreppedDlist(
            handle,
            side,
            None if side == "local" else agent_name,
            peer.generation if peer else None,
            mem,
            triples,
            regions,
        )
        return handle

    def releasedDlistH(self, handle: int) -> S.nixl_status_t:
        if self.dlists.pop(handle, None) is not None:
            self.released_handles.add(handle)
        return S.nixl_status_t.NIXL_SUCCESS

    # -- requests ---------------------------------------------------------------------------------------------
    def makeXferReq(
        self,
        op: Any,
        local_h: int,
        local_idx: Any,
        remote_h: int,
        remote_idx: Any,
        notif: bytes | str = b"",
        backends: list | None = None,
        skip_desc_merge: bool = False,
    ) -> int:
        self._enter()
        local, remote = self.dlists.get(local_h), self.dlists.get(remote_h)
        if local is None or remote is None:
            S.fail(S.INVALID_PARAM, "makeXferReq: invalid descriptor list handle")
        if local.side != "local" or remote.side == "local":
            S.fail(S.INVALID_PARAM, "makeXferReq: local and remote descriptor list handles are swapped")
        li = _indices(local_idx)  # pybind casts them before 1.5.1 looks at anything
        ri = li if remote_idx is local_idx else _indices(remote_idx)
        if remote.side == "remote":
            assert remote.peer is not None  # a remote list names its peer
            known = self.peers.get(remote.peer)
            if known is None or known.generation != remote.generation:  # removed (and maybe added again) since
                S.fail(
                    S.NOT_FOUND,
                    f"makeXferReq: remote agent '{remote.peer}' was removed after its descriptor list was prepared",
                )
        if not li or len(li) != len(ri):
            S.fail(S.INVALID_PARAM, f"makeXferReq: different index counts (local={len(li)}, remote={len(ri)})")
        lt, rt = local.triples, remote.triples
        lregs: Sequence[Region]
        rregs: Sequence[Region]
        n = len(li)
        if li == ri and n == len(lt) == len(rt) and li == _in_order(n):  # every EPLB READ: both lists whole
            pairs = [(loc[0], r[0], loc[1]) for loc, r in zip(lt, rt) if loc[1] == r[1]]
            if len(pairs) != n:
                k = next(k for k, (loc, r) in enumerate(zip(lt, rt)) if loc[1] != r[1])
                S.fail(S.INVALID_PARAM, f"makeXferReq: length mismatch at index {k}")
            lregs, rregs = local.regions, remote.regions  # tuples, shared: never changed
        else:
            if min(li) < 0 or max(li) >= len(lt) or min(ri) < 0 or max(ri) >= len(rt):
                for values, given in ((li, local_idx), (ri, remote_idx)):
                    if max(values) > _INT_MAX or min(values) < _INT_MIN:  # pybind would not have cast it
                        _cast_error(given)
                S.fail(S.INVALID_PARAM, "makeXferReq: descriptor index out of range")
            pairs, lpicked, rpicked = [], [], []
            local_regions, remote_regions = local.regions, remote.regions
            for k, (i, j) in enumerate(zip(li, ri)):
                (la, ln, _), (ra, rn, _) = lt[i], rt[j]
                if ln != rn:
                    S.fail(S.INVALID_PARAM, f"makeXferReq: length mismatch at index {k}")
                pairs.append((la, ra, ln))
                lpicked.append(local_regions[i])
                rpicked.append(remote_regions[j])
            lregs, rregs = lpicked, rpicked
        peer = remote.peer if remote.side == "remote" and remote.peer is not None else self.name
        return self._new_req(op, peer, remote.generation, pairs, lregs, rregs, notif)

    def createXferReq(
        self,
        op: Any,
        local_descs: Any,
        remote_descs: Any,
        remote_agent: str,
        notif: bytes | str = b"",
        backends: list | None = None,
    ) -> int:
        self._enter()
        self._refuse_posix_only(backends, "createXferReq")
        lt = self._xfer_triples(local_descs, "createXferReq")
        rt = self._xfer_triples(remote_descs, "createXferReq")
        if not lt and not rt:
            self._no_registration("createXferReq")  # nothing for any backend to move
        if len(lt) != len(rt):
            S.fail(
                S.INVALID_PARAM, f"createXferReq: different descriptor list sizes (local={len(lt)}, remote={len(rt)})"
            )
        for k, (loc, r) in enumerate(zip(lt, rt)):
            if loc[1] != r[1]:
                S.fail(S.INVALID_PARAM, f"createXferReq: length mismatch at index {k}")
        side, peer, lookup = self._remote_side(remote_agent, "createXferReq")
        lmem, rmem = int(local_descs.getType()), int(remote_descs.getType())
        lregs = [self._local_region(lmem, *t) for t in lt]
        rregs = [lookup(rmem, *t) for t in rt]
        if None in lregs or None in rregs:
            self._no_registration("createXferReq")
        pairs = [(loc[0], r[0], loc[1]) for loc, r in zip(lt, rt)]
        return self._new_req(op, remote_agent, peer.generation if peer else None, pairs, lregs, rregs, notif)

    def _new_req(self, op: Any, peer: str, generation: int | None, pairs, lregs, rregs, notif) -> int:
        fabric = self.fabric
        handle = _handle_value(fabric)
        msg = notif if type(notif) is bytes else notif.encode() if isinstance(notif, str) else bytes(notif)
        req = self.xfers[handle] = XferReq(
            handle, _OPS.get(op) or _OPS[int(op)], peer, generation, pairs, lregs, rregs, msg
        )
        thread_of = fabric.thread_of
        if thread_of is not None:
            owner = req.owner = thread_of()
            if owner is not None:
                owners = self.req_owners
                owners[owner] = owners.get(owner, 0) + 1
        return handle

    # -- posting and progress -------------------------------------------------------------------------------
    def _req(self, handle: int, call: str) -> XferReq:
        req = self.xfers.get(handle)
        if req is None:
            if handle in self.released_handles:
                return _RELEASED
            S.fail(S.NOT_FOUND, f"{call}: unknown transfer request handle")
        return req

    def _stale(self, req: XferReq, peer: Any = _LOOKUP) -> bool:
        """``req`` was made against a peer entry that has since been removed (or removed and added again);
        ``peer``: the entry of ``req.peer`` if the caller has it."""
        if req.generation is None:  # loopback
            return False
        if peer is _LOOKUP:
            peer = self.peers.get(req.peer)
        return peer is None or peer.generation != req.generation

    def _released_use(self, what: str) -> None:
        if self.fabric.profile.released_handle_use == "crash":
            raise S.SimulatedCrash("SIGSEGV", f"{what} on a released transfer handle (real NIXL 1.5.1 segfaults)")
        S.fail(S.INVALID_PARAM, f"{what}: transfer handle was released")

    def _access_error(self, req: XferReq, peer: Any = _LOOKUP) -> tuple[int, str] | None:
        """Why the bytes of ``req`` cannot be moved now, as (status, reason), or None if they can.  ``peer``: the
        peer entry of ``req.peer`` if the caller has it (None: not a peer)."""
        fabric = self.fabric
        profile = fabric.profile
        target: AgentParts | None
        if req.peer == self.name:
            target = self
        else:
            if peer is _LOOKUP:
                peer = self.peers.get(req.peer)
            target = self._target(peer) if peer is not None else None
            if target is None:
                return S.REMOTE_DISCONNECT, f"remote agent '{req.peer}' is disconnected"
        freed = fabric.has_freed()
        must_be_live = profile.unregistered_access == "fail"
        if not freed and not profile.detect_recycled:  # what every transfer of a healthy run takes: no memory freed
            if not must_be_live:
                return None
            remote_live, local_live = target.region_index.members, self.region_index.members
            for lreg, rreg in zip(req.local_regions, req.remote_regions):
                if rreg not in remote_live:
                    return S.REMOTE_DISCONNECT, "remote key no longer valid (deregistered): endpoint failed"
                if lreg not in local_live:
                    return S.BACKEND, "local key no longer valid (deregistered)"
            return None
        for (la, ra, n), lreg, rreg in zip(req.pairs, req.local_regions, req.remote_regions):
            if freed and fabric.is_freed(ra, n):
                return S.REMOTE_DISCONNECT, "remote memory was unmapped: UCX I/O error failed the endpoint"
            if freed and fabric.is_freed(la, n):
                if profile.released_handle_use == "crash":
                    raise S.SimulatedCrash("SIGSEGV", "transfer into local memory that was unmapped")
                return S.BACKEND, "local memory was unmapped"
            live_remote = rreg in target.region_index
            if (
                profile.detect_recycled
                and not live_remote
                and any(r.addr == rreg.addr and r.length != rreg.length for r in target.regions)
            ):
                return S.NOT_FOUND, "remote address was recycled with a different extent"
            if must_be_live:
                if not live_remote:
                    return S.REMOTE_DISCONNECT, "remote key no longer valid (deregistered): endpoint failed"
                if lreg not in self.region_index:
                    return S.BACKEND, "local key no longer valid (deregistered)"
        return None

    def _telemetry_now(self) -> float:
        """Seconds on the telemetry clock: simulated time inside the simulator, the host's monotonic clock outside
        (NIXL's is the host's steady clock)."""
        clock = self.fabric._clock
        return clock() if clock is not None else time.monotonic()

    def postXferReq(self, handle: int, notif: bytes | str = b"") -> S.nixl_status_t:
        self._enter()
        started = self._telemetry_now() if self.telemetry else 0.0
        req = self.xfers.get(handle) or self._req(handle, "postXferReq")
        if req.released:
            self._released_use("transfer()")
        if req.state == PROC:
            S.fail(S.REPOST_ACTIVE, "postXferReq: transfer request is still in progress and cannot be reposted")
        peer = self.peers.get(req.peer)  # None for loopback (an agent is never its own peer)
        if self._stale(req, peer):
            S.fail(
                S.NOT_FOUND,
                f"postXferReq: remote agent '{req.peer}' was invalidated or re-registered after "
                "transfer request creation; not posting stale handle",
            )
        if notif:
            req.notif = notif.encode() if isinstance(notif, str) else bytes(notif)  # persists for reposts (fact 19)
        faults = self.fabric.faults
        armed = bool(faults.armed)  # the common case: nothing to ask the fault board (four sites per post)
        if (
            armed
            and peer is not None
            and not peer.failed
            and faults.take("peer.disconnect", self.name, req.peer, pid=self.pid, nth="after_posts")
        ):
            self._fail_endpoint(peer, "injected fault peer.disconnect")
        problem = self._access_error(req, peer)
        if problem is not None:
            code, why = problem
            if code == S.REMOTE_DISCONNECT and peer is not None and not peer.failed:
                self._fail_endpoint(peer, why)
            # The request was posted and failed: like 1.5.1, its state is now that error, and every later check
            # raises it (a DONE from an earlier post must not survive a failed repost).
            req.state, req.error = ERR, code
            S.fail(code, f"postXferReq: {why}")
        req.state, req.polls, req.epoch, req.finished = PROC, 0, req.epoch + 1, False
        req.fail_after = faults.take("xfer.fail_after", self.name, req.peer, pid=self.pid) if armed else None
        wired = self.wired_to_self if req.peer == self.name else (peer is not None and peer.wired)
        delay = self.fabric.xfer_duration(req.nbytes, req.op, wired, self.pid)
        if armed:
            if req.fail_after is not None or faults.take("xfer.stuck", self.name, req.peer, pid=self.pid) is not None:
                delay = float("inf")  # a failing transfer never completes: it raises at its Nth check
            else:
                late = faults.take("xfer.late", self.name, req.peer, pid=self.pid)
                if late is not None:
                    delay += float(late.params.get("delay", 1.0))
        self._emit_xfer("xfer.post", req, peer)
        posted = None
        if self.telemetry:
            posted = (started, self._telemetry_now())
            req.posted, req.done_at = posted, None
        if delay <= 0:
            self._complete(req, req.epoch)
            if req.finished:
                req.state = DONE
                if posted is not None:
                    req.done_at = posted[1]
                self._notify(req)  # completed within the post: the notification goes with it
            return S.nixl_status_t.NIXL_SUCCESS if req.state == DONE else S.nixl_status_t.NIXL_IN_PROG
        epoch = req.epoch
        req.due = self.fabric.schedule(delay, lambda: self._complete(req, epoch))
        return S.nixl_status_t.NIXL_IN_PROG

    def _emit_xfer(self, kind: str, req: XferReq, peer: Any = _LOOKUP) -> None:
        fabric = self.fabric
        raw, listeners = fabric.xfer_listeners, fabric.listeners
        if not raw and not listeners:
            return
        target: str | None
        if req.peer == self.name:
            target = self.conn
        else:
            if peer is _LOOKUP:
                peer = self.peers.get(req.peer)
            target = peer.conn if peer is not None else None
        for listener in raw:
            listener(kind, self, req, target)
        if listeners:
            spans = req.spans
            fields = {
                "agent": self.name,
                "pid": self.pid,
                "conn": self.conn,
                "peer": req.peer,
                "target": target,
                "op": req.op,
                "nbytes": req.nbytes,
                "local": list(spans[0]),
                "remote": list(spans[1]),
            }
            for listen in listeners:
                listen(kind, fields)

    def _complete(self, req: XferReq, epoch: int) -> None:
        if req.state != PROC or req.epoch != epoch or self.destroyed:
            return
        loopback = req.peer == self.name
        peer = None if loopback else self.peers.get(req.peer)
        problem = self._access_error(req, peer)
        if problem is not None:
            req.state, req.error = ERR, problem[0]
            return
        if req.op == "READ":
            for la, ra, n in req.pairs:
                if n:
                    memmove(la, ra, n)
        else:
            for la, ra, n in req.pairs:
                if n:
                    memmove(ra, la, n)
        # Like UCX, the request's state only changes when its owner checks it (a repost before that is
        # REPOST_ACTIVE even if the bytes have arrived), and so does its notification: 1.5.1 sends it from the
        # check that finds the request complete (observed on tcp, and on cma for a READ still in flight at its
        # post), and never for a request released before that check, whose bytes land all the same.
        req.finished = True
        if loopback:
            self.wired_to_self = True
        elif peer is not None:
            peer.wired = True
        self._emit_xfer("xfer.done", req, peer)

    def _notify(self, req: XferReq) -> None:
        """The request's notification, if it carries one, to its target (once per post that completed)."""
        if req.notif:
            target = self if req.peer == self.name else self._target(self.peers[req.peer])
            if target is not None:
                self._send_notif(target, req.peer, req.notif)

    def getXferStatus(self, handle: int) -> S.nixl_status_t:
        self._enter()
        req = self.xfers.get(handle) or self._req(handle, "getXferStatus")
        if req.released:
            if self.fabric.profile.released_handle_use == "crash":
                return S.nixl_status_t.NIXL_SUCCESS  # 1.5.1 reads the freed request: a stale DONE (fact 22)
            S.fail(S.INVALID_PARAM, "getXferStatus: transfer handle was released")
        if req.state == NEW:
            S.fail(S.NOT_POSTED, "getXferStatus: transfer request was not posted")
        if req.state != DONE and self._stale(req):  # a DONE state is sticky, even towards a removed peer
            S.fail(
                S.NOT_FOUND,
                f"getXferStatus: remote agent '{req.peer}' was invalidated or re-registered during transfer",
            )
        if req.state == PROC:
            req.polls += 1
            fault = req.fail_after
            if fault is not None and req.polls >= int(fault.params.get("polls", 1)):
                req.state = ERR
                req.error = STATUS_BY_NAME[fault.params.get("error", "REMOTE_DISCONNECT")]
            elif req.finished:
                req.state = DONE
                if self.telemetry:
                    req.done_at = self._telemetry_now()
                self._notify(req)
            elif req.peer != self.name and self._target(self.peers[req.peer]) is None:
                req.state, req.error = ERR, S.REMOTE_DISCONNECT  # tcp in flight: the next check raises (fact 26)
        if req.state == ERR:
            S.fail(req.error, f"getXferStatus: transfer failed with {S.name_of(req.error)}")
        if req.state == DONE:
            return S.nixl_status_t.NIXL_SUCCESS
        if self.fabric.poll_wait is not None:
            self.fabric.poll_wait(req.due)
        return S.nixl_status_t.NIXL_IN_PROG

    def releaseXferReq(self, handle: int) -> S.nixl_status_t:
        self._enter()
        req = self.xfers.get(handle) or self._req(handle, "releaseXferReq")
        # A request still in flight is not cancelled: release returns at once and its bytes keep landing (a whole
        # 1 GiB READ or WRITE over tcp, observed on 1.5.1), with no notification, since no check will find it done.
        req.released = True
        if self.xfers.pop(handle, None) is not None:
            self.released_handles.add(handle)
            if req.owner is not None:
                left = self.req_owners[req.owner] - 1
                if left:
                    self.req_owners[req.owner] = left
                else:
                    del self.req_owners[req.owner]
        return S.nixl_status_t.NIXL_SUCCESS

    # -- queries ------------------------------------------------------------------------------------------------
    def estimateXferCost(self, handle: int) -> tuple[int, int, int]:
        self._req(handle, "estimateXferCost")
        return 0, 0, -1  # UCX has no cost model: the Python layer reports method "UNKNOWN"

    def getXferTelemetry(self, handle: int) -> nixlXferTelemetry:
        """The last post's telemetry, in microseconds (observed on 1.5.1, case telemetry_switches): ``startTime`` on
        the clock, ``postDuration`` the post itself, ``xferDuration`` from the post's start until a check saw the
        transfer done (until now while it is not); whole microseconds, and a post never takes none."""
        req = self._req(handle, "getXferTelemetry")
        if not self.telemetry:
            S.fail(S.NO_TELEMETRY, "getXferTelemetry: cannot return values when telemetry is not enabled.")
        if req.posted is None:
            return nixlXferTelemetry(totalBytes=req.nbytes, descCount=len(req.pairs))
        start, end = req.posted
        post = max(1, round((end - start) * 1e6))
        done = req.done_at if req.done_at is not None else self._telemetry_now()
        return nixlXferTelemetry(
            startTime=max(1, round(start * 1e6)),
            postDuration=post,
            xferDuration=max(post, round((done - start) * 1e6)),
            totalBytes=req.nbytes,
            descCount=len(req.pairs),
        )

    def queryXferBackend(self, handle: int) -> int:
        self._req(handle, "queryXferBackend")
        return next(h for h, name in self.backends.items() if name == "UCX")
