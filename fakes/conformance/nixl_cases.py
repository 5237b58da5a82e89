"""The catalogue.  Each case returns its observation; the decorator says what ``dram`` (and any differing profile)
expects.  Names say the behaviour; docstrings say the fact it pins (``Fact 21:``, numbered as in
docs/reference/nixl-1.5.1.md, whose table names the cases that check each fact)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from .backend import PATTERN, Backend
from .catalogue import case, observe

N = 4096


def _pair(b: Backend, n: int = N):
    """Initiator B, target A; A's buffer holds PATTERN, B's is zero; B knows A."""
    a, t = b.agent("A"), b.buf(n, PATTERN)
    bb, u = b.agent("B"), b.buf(n, 0)
    b.reg(a, t)
    b.reg(bb, u)
    bb.add_remote_agent(a.get_agent_metadata())
    return a, t, bb, u


def _finish(b: Backend, agent, handle) -> str:
    return b.wait(lambda: agent.check_xfer_state(handle) == "DONE") and "DONE"


def _read(b: Backend, bb, u, t, remote="A", notif=b""):
    h = bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, t), remote, notif)
    first = bb.transfer(h)
    return h, first


# -- agents and backends ------------------------------------------------------------------------------------
@case("ValueError")
def agent_empty_name(b: Backend):
    """Fact 2: an empty agent name is refused by the constructor."""
    return observe(lambda: b.agent(""))


@case([[], ["DRAM_SEG", "VRAM_SEG"]])
def agent_unknown_backend_is_skipped(b: Backend):
    """Fact 2: a backend without a plugin is skipped with a warning; UCX offers DRAM and VRAM."""
    x = b.agent("X", backends=["NOPE"])
    y = b.agent("Y")
    return [list(x.backends), y.get_backend_mem_types("UCX")]


@case(["nixlInvalidParamError", "nixlNotFoundError"])
def create_backend_twice_or_unknown(b: Backend):
    """Fact 2: creating UCX again is INVALID_PARAM; an unknown plugin is NOT_FOUND."""
    a = b.agent("A")
    return [observe(lambda: a.create_backend("UCX")), observe(lambda: a.create_backend("NOPE"))]


@case([True, "nixlNotAllowedError", "A"])
def duplicate_agent_name(b: Backend):
    """Fact 1: two agents may share a name; a peer that knows the first refuses the second's metadata."""
    a1, a2, p = b.agent("A"), b.agent("A"), b.agent("P")
    p.add_remote_agent(a1.get_agent_metadata())
    return [
        a1.get_agent_metadata() != a2.get_agent_metadata(),
        observe(lambda: p.add_remote_agent(a2.get_agent_metadata())),
        observe(lambda: p.add_remote_agent(a1.get_agent_metadata()).decode()),
    ]


# -- registration ------------------------------------------------------------------------------------------
@case([1, "DRAM_SEG", [N, 0, "b''"]])
def register_tensor(b: Backend):
    """Fact 5: register_memory returns the nixlRegDList it registered, meta as bytes."""
    a, t = b.agent("A"), b.buf(N)
    descs = a.register_memory(t)
    addr, length, dev, meta = descs[0]
    return [descs.descCount(), descs.getType().name.replace("VRAM", "DRAM"), [length, dev, repr(meta)]]


@case([None, None, "DONE"], rocm_strict=[None, "nixlBackendError", "DONE"])
def register_same_range_twice(b: Backend):
    """Fact 3: the same range registered twice is accepted (rocm-strict: the second is refused)."""
    a, t = b.agent("A"), b.buf(N, 3)
    u = b.buf(N)
    first = observe(lambda: b.reg(a, t) and None)
    second = observe(lambda: b.reg(a, t) and None)
    b.reg(a, u)
    h = a.initialize_xfer("READ", b.descs(a, u), b.descs(a, t), "A")
    a.transfer(h)
    return [first, second, _finish(b, a, h)]


@case([None, "nixlNotFoundError"], rocm_strict=["nixlBackendError", "nixlNotFoundError"])
def register_overlapping_ranges(b: Backend):
    """Fact 4: overlapping ranges are accepted; a descriptor spanning two regions is NOT_FOUND at creation."""
    a, t, u = b.agent("A"), b.buf(3 * 1024), b.buf(3 * 1024)
    b.reg(a, t, offset=0, length=2048)
    second = observe(lambda: b.reg(a, t, offset=1024, length=2048) and None)
    b.reg(a, u)
    spanning = observe(lambda: a.initialize_xfer("READ", b.descs(a, u), b.descs(a, t), "A") and None)
    return [second, spanning]


@case(["TypeError", "TypeError", None])
def register_bad_descriptor_shapes(b: Backend):
    """Fact 5: 3-tuples or a missing mem_type log an error and become a TypeError; an Nx3 array is accepted."""
    a, t = b.agent("A"), b.buf(N)
    rows = np.array([list(b.xd(t)[0])], dtype=np.uint64)
    return [
        observe(lambda: a.register_memory(b.xd(t), b.memory)),
        observe(lambda: a.register_memory(b.rd(t))),
        observe(lambda: a.register_memory(rows, b.memory) and None),
    ]


@case("TypeError")
def register_noncontiguous_tensor(b: Backend):
    """Fact 5: a non-contiguous tensor is refused (logged, then TypeError)."""
    import torch

    a = b.agent("A")
    return observe(lambda: a.register_memory(torch.zeros(8, 8, device=b.device)[:, 1]))


@case([None, None], needs=("host-memory", "no-cuda-context"))
def register_degenerate_ranges(b: Backend):
    """Fact 6: zero length and a tiny address are accepted on DRAM (no validation).  Where UCX classifies memory
    through CUDA (VRAM on an H200, or host memory once the process has a CUDA context) it refuses them with
    nixlBackendError; the fake does not model that classification."""
    a, t = b.agent("A"), b.buf(N)
    return [
        observe(lambda: a.register_memory([(t.data_ptr(), 0, b.dev(t), "")], b.memory) and None),
        observe(lambda: a.register_memory([(0x10, 16, b.dev(t), "")], b.memory) and None),
    ]


@case("nixlBackendError", cuda=None, rocm_strict=None)
def register_as_vram(b: Backend):
    """Fact 7: the run's memory registered as VRAM: host memory is refused by UCX, device memory accepted."""
    a, t = b.agent("A"), b.buf(N)
    return observe(lambda: a.register_memory(b.rd(t), "VRAM") and None)


@case("nixlNotFoundError")
def register_file_type(b: Backend):
    """Fact 7: FILE memory has no backend in a UCX-only agent."""
    a, t = b.agent("A"), b.buf(N)
    return observe(lambda: a.register_memory(b.rd(t), "FILE"))


@case(["nixlNotFoundError", "nixlNotFoundError", None, "nixlNotFoundError"])
def deregister_matching(b: Backend):
    """Fact 8: exact match on (devId, addr, len), meta ignored; a second deregistration is NOT_FOUND."""
    a, t = b.agent("A"), b.buf(N)
    b.reg(a, t)
    ((addr, n, dev, _),) = b.rd(t)
    return [
        observe(lambda: a.deregister_memory(a.get_reg_descs([(addr, n // 2, dev, "")], b.memory))),
        observe(lambda: a.deregister_memory(a.get_reg_descs([(addr, n, dev + 1, "")], b.memory))),
        observe(lambda: a.deregister_memory(a.get_reg_descs([(addr, n, dev, "other")], b.memory))),
        observe(lambda: a.deregister_memory(a.get_reg_descs([(addr, n, dev, "")], b.memory))),
    ]


@case(["nixlNotFoundError", True, "ok", "nixlNotFoundError", None])
def deregister_all_or_nothing(b: Backend):
    """Fact 8, and a quirk of 1.5.1: a list with one unknown entry raises NOT_FOUND and deregisters nothing (the
    metadata is unchanged, the known entry is still usable locally and can still be deregistered), yet a loopback
    request naming that entry as its remote side is NOT_FOUND from then on."""
    a, t, u = b.agent("A"), b.buf(N, 5), b.buf(N)
    b.reg(a, t)
    b.reg(a, u)
    md = a.get_agent_metadata()
    bad = b.rd(t) + [(t.data_ptr() + 8, 8, b.dev(t), "")]
    outcome = observe(lambda: a.deregister_memory(a.get_reg_descs(bad, b.memory)))
    as_local = observe(lambda: a.initialize_xfer("READ", b.descs(a, t), b.descs(a, u), "A") and "ok")
    as_remote = observe(lambda: a.initialize_xfer("READ", b.descs(a, u), b.descs(a, t), "A") and "ok")
    return [
        outcome,
        md == a.get_agent_metadata(),
        as_local,
        as_remote,
        observe(lambda: a.deregister_memory(a.get_reg_descs(b.rd(t), b.memory))),
    ]


@case("SIGSEGV", isolate=True, hardened="nixlInvalidParamError")
def deregister_same_range_twice_in_one_list(b: Backend):
    """Observed on 1.5.1 (DRAM): one deregister_memory list naming a range twice kills the process, whether the range
    was registered once or twice (two tensors on one storage give such a list); the fake raises instead in every
    profile but dram."""
    a, t = b.agent("A"), b.buf(N)
    b.reg(a, t)
    return observe(lambda: a.deregister_memory(a.get_reg_descs(b.rd(t) * 2, b.memory)))


@case(["nixlBackendError", "nixlNotFoundError", "IndexError", "nixlNotFoundError"])
def empty_descriptor_lists(b: Backend):
    """Observed on 1.5.1: an empty registration list is a backend error, an empty prepared list and a request with
    no descriptors on either side are NOT_FOUND, and an empty (0x3) numpy array fails where it is first indexed."""
    a, t, bb, u = _pair(b)
    mem = getattr(b.bindings, f"{b.memory}_SEG")
    empty = b.bindings.nixlXferDList(mem)
    return [
        observe(lambda: a.register_memory(b.bindings.nixlRegDList(mem))),
        observe(lambda: bb.prep_xfer_dlist("A", empty)),
        observe(lambda: bb.get_xfer_descs(np.zeros((0, 3), dtype=np.uint64), b.memory)),
        observe(lambda: bb.initialize_xfer("READ", empty, empty, "A")),
    ]


# -- metadata ----------------------------------------------------------------------------------------------
@case([True, True, True, True])
def metadata_is_stable_and_grows(b: Backend):
    """Fact 9: metadata is bytes, identical when asked twice, and grows with every registered region."""
    a = b.agent("A")
    sizes = [len(a.get_agent_metadata())]
    bufs = [b.buf(N, 1), b.buf(N, 2)]  # kept alive: a freed buffer's address comes back for the next one
    for t in bufs:
        b.reg(a, t)
        sizes.append(len(a.get_agent_metadata()))
    return [
        isinstance(a.get_agent_metadata(), bytes),
        a.get_agent_metadata() == a.get_agent_metadata(),
        sizes[0] < sizes[1],
        sizes[1] < sizes[2],
    ]


@case(["nixlNotFoundError", "A", "DONE", "DONE"])
def stale_metadata_until_reload(b: Backend):
    """Fact 10: a region registered after the peer loaded us is NOT_FOUND there until it reloads; the reload is
    additive and the old handle stays valid."""
    a, t, bb, u = _pair(b)
    old, _ = _read(b, bb, u, t)
    _finish(b, bb, old)
    t2 = b.buf(N, 9)
    b.reg(a, t2)
    before = observe(lambda: bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, t2), "A"))
    name = bb.add_remote_agent(a.get_agent_metadata()).decode()
    h = bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, t2), "A")
    bb.transfer(h)
    new = _finish(b, bb, h)
    bb.transfer(old)
    return [before, name, new, _finish(b, bb, old)]


@case([True, "A", "DONE"], rdma=[False, "nixlNotAllowedError", "nixlRemoteDisconnectError"])
def reregister_same_range(b: Backend):
    """Fact 11: deregister + register of the same range gives byte-identical metadata; the peer's reload is fine and
    its old handle still posts.  rdma: a new remote key, refused on reload; the old handle fails."""
    a, t, bb, u = _pair(b)
    h, _ = _read(b, bb, u, t)
    _finish(b, bb, h)
    md1 = a.get_agent_metadata()
    a.deregister_memory(a.get_reg_descs(b.rd(t), b.memory))
    b.reg(a, t)
    md2 = a.get_agent_metadata()
    reload = observe(lambda: bb.add_remote_agent(md2).decode())
    return [md1 == md2, reload, observe(lambda: bb.transfer(h) and _finish(b, bb, h))]


@case(["nixlInvalidParamError", "nixlMismatchError", "nixlMismatchError", "nixlMismatchError"])
def load_bad_metadata(b: Backend):
    """Fact 12: own metadata is INVALID_PARAM; garbage, empty or truncated bytes are MISMATCH."""
    a, bb = b.agent("A"), b.agent("B")
    md = bb.get_agent_metadata()
    return [
        observe(lambda: a.add_remote_agent(a.get_agent_metadata())),
        observe(lambda: a.add_remote_agent(b"x")),
        observe(lambda: a.add_remote_agent(b"")),
        observe(lambda: a.add_remote_agent(md[: len(md) // 2])),
    ]


@case(["bytes", "A", "A"])
def load_same_metadata_twice(b: Backend):
    """Fact 13: add_remote_agent returns the name as bytes, and the same metadata again is a no-op success."""
    a, bb = b.agent("A"), b.agent("B")
    first = bb.add_remote_agent(a.get_agent_metadata())
    second = bb.add_remote_agent(a.get_agent_metadata())
    return [type(first).__name__, first.decode(), second.decode()]


@case([False, True, True, False])
def check_remote_metadata(b: Backend):
    """Fact 14: False before loading, True after (also with no regions), with descriptors True only if covered."""
    a, t = b.agent("A"), b.buf(N)
    bb = b.agent("B")
    before = bb.check_remote_metadata("A")
    empty = b.agent("E")
    bb.add_remote_agent(empty.get_agent_metadata())
    b.reg(a, t)
    bb.add_remote_agent(a.get_agent_metadata())
    covered = bb.check_remote_metadata("A", bb.get_xfer_descs(b.xd(t), b.memory))
    outside = bb.check_remote_metadata("A", bb.get_xfer_descs(b.xd(t, offset=N - 8, length=16), b.memory))
    return [before, bb.check_remote_metadata("E"), covered, outside]


@case([True, "A", True, False])
def partial_metadata(b: Backend):
    """Partial metadata carries only the named regions (and the connection if asked); it loads like the full one."""
    a, t1, t2 = b.agent("A"), b.buf(N, 1), b.buf(N, 2)
    d1 = b.reg(a, t1)
    b.reg(a, t2)
    part = a.get_partial_agent_metadata(d1, inc_conn_info=True)
    bb = b.agent("B")
    name = bb.add_remote_agent(part).decode()
    return [
        len(part) < len(a.get_agent_metadata()),
        name,
        bb.check_remote_metadata("A", bb.get_xfer_descs(b.xd(t1), b.memory)),
        bb.check_remote_metadata("A", bb.get_xfer_descs(b.xd(t2), b.memory)),
    ]


@case(["nixlInvalidParamError"] * 3)
def metadata_exchange_without_store(b: Backend):
    """Fact 15: send/fetch/invalidate with no address and no central store are INVALID_PARAM."""
    a = b.agent("A")
    return [
        observe(a.invalidate_local_metadata),
        observe(a.send_local_metadata),
        observe(lambda: a.fetch_remote_metadata("B")),
    ]


@case(["nixlNotFoundError", "nixlNotSupportedError", "nixlNoTelemetryError", [0, 0, "UNKNOWN"], "UCX"])
def misc_queries(b: Backend):
    """Fact 16: make_connection to an unknown peer, query_memory, telemetry off, the cost estimate, the backend."""
    a, t, bb, u = _pair(b)
    h = bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, t), "A")
    return [
        observe(lambda: bb.make_connection("X")),
        observe(lambda: a.query_memory(b.rd(t), "UCX", b.memory)),
        observe(lambda: bb.get_xfer_telemetry(h)),
        list(bb.estimate_xfer_cost(h)),
        bb.query_xfer_backend(h),
    ]


# -- transfers ---------------------------------------------------------------------------------------------
@case([True, "DONE", True])
def read_initialize_xfer(b: Backend):
    """Fact 17: a READ through initialize_xfer moves the bytes; transfer() says PROC or DONE."""
    a, t, bb, u = _pair(b)
    h, first = _read(b, bb, u, t)
    return [first in ("PROC", "DONE"), _finish(b, bb, h), b.same(t, u)]


@case([True, "DONE", True])
def write_initialize_xfer(b: Backend):
    """Fact 17: a WRITE moves the bytes to the target."""
    a, t, bb, u = _pair(b)
    u.fill_(11)
    h = bb.initialize_xfer("WRITE", b.descs(bb, u), b.descs(bb, t), "A")
    first = bb.transfer(h)
    return [first in ("PROC", "DONE"), _finish(b, bb, h), b.same(t, u)]


@case(["PROC", "DONE"])
def first_write_waits_for_the_endpoint(b: Backend):
    """Observed on 1.5.1: the first WRITE towards a peer returns PROC from transfer(), as a first READ does, while
    the endpoint connects (host memory and H200 VRAM alike; on VRAM a later WRITE reads PROC too, on host memory
    DONE)."""
    a, t, bb, u = _pair(b)
    h = bb.initialize_xfer("WRITE", b.descs(bb, u), b.descs(bb, t), "A")
    first = bb.transfer(h)
    return [first, _finish(b, bb, h)]


@case(["DONE", True, "DONE", True])
def read_prepped(b: Backend):
    """Fact 21: prep_xfer_dlist + make_prepped_xfer with int32 or int64 numpy indices."""
    a, t, bb, u = _pair(b)
    half = N // 2
    local = bb.prep_xfer_dlist("NIXL_INIT_AGENT", b.xd(u, 0, half) + b.xd(u, half, half), b.memory)
    remote = bb.prep_xfer_dlist("A", b.xd(t, 0, half) + b.xd(t, half, half), b.memory)
    out = []
    for dtype in (np.int32, np.int64):
        u.zero_()
        h = bb.make_prepped_xfer("READ", local, np.array([1, 0], dtype=dtype), remote, np.array([1, 0], dtype=dtype))
        bb.transfer(h)
        out += [_finish(b, bb, h), b.same(t, u)]
    return out


@case([{"B": ["hi"]}, {"B": ["x", "x"]}])
def transfer_notifications(b: Backend):
    """Fact 19: the target receives the notif after the transfer; an override at transfer() persists."""
    a, t, bb, u = _pair(b)
    h, _ = _read(b, bb, u, t, notif=b"hi")
    _finish(b, bb, h)
    first = b.wait(a.get_new_notifs)
    bb.transfer(h, b"x")
    _finish(b, bb, h)
    got: dict = {}
    b.wait(
        lambda: (
            [got.setdefault(k, []).extend(v) for k, v in a.get_new_notifs().items()]
            and False
            or len(got.get("B", [])) >= 1
        )
    )
    bb.transfer(h)
    _finish(b, bb, h)
    b.wait(
        lambda: (
            [got.setdefault(k, []).extend(v) for k, v in a.get_new_notifs().items()]
            and False
            or len(got.get("B", [])) >= 2
        )
    )
    return [
        {k: [m.decode() for m in v] for k, v in first.items()},
        {k: [m.decode() for m in v] for k, v in got.items()},
    ]


def _collect(a, got: dict) -> dict:
    for k, v in a.get_new_notifs().items():
        got.setdefault(k, []).extend(m.decode() for m in v)
    return got


@case(["PROC", True, {}, "DONE", {"B": ["n"]}], transport="tcp")
def notification_waits_for_the_initiators_check(b: Backend):
    """Fact 19: the notification of a READ in flight at its post is sent by the initiator's check that finds it done:
    with the bytes landed and no check, the target has nothing (observed on tcp, 1.5.1)."""
    a, t, bb, u = _pair(b, 1 << 20)
    h, first = _read(b, bb, u, t, notif=b"n")
    if first == "DONE":
        return "completed at post"
    got: dict = {}
    landed = bool(b.wait(lambda: _collect(a, got) is not None and b.same(t, u)))
    b.wait(lambda: _collect(a, got) and False, 20)  # a while longer: still nothing
    before = dict(got)
    state = _finish(b, bb, h)
    b.wait(lambda: _collect(a, got))
    return [first, landed, before, state, got]


@case(["PROC", None, True, {}], transport="tcp")
def released_in_flight_still_lands(b: Backend):
    """Fact 22: releasing a READ still in flight returns at once and does not cancel it: its bytes land (16 MiB over
    tcp here; a whole 1 GiB READ or WRITE when probed), and its notification is never sent."""
    a, t, bb, u = _pair(b, 16 << 20)
    h, first = _read(b, bb, u, t, notif=b"n")
    if first == "DONE":
        return "completed at post"
    released = observe(lambda: bb.release_xfer_handle(h))
    got: dict = {}
    landed = bool(b.wait(lambda: _collect(a, got) is not None and b.same(t, u), 400))
    b.wait(lambda: _collect(a, got) and False, 20)
    return [first, released, landed, got]


@case([None, {"B": ["yo"]}, "nixlNotFoundError"])
def standalone_notification(b: Backend):
    """send_notif reaches a known peer; towards an unknown name it is NOT_FOUND."""
    a, t, bb, u = _pair(b)
    sent = observe(lambda: bb.send_notif("A", b"yo"))
    got = b.wait(a.get_new_notifs)
    return [sent, {k: [m.decode() for m in v] for k, v in got.items()}, observe(lambda: bb.send_notif("X", b"x"))]


@case(["DONE", True])
def repost_done_handle(b: Backend):
    """Fact 17: a DONE handle can be posted again and moves the current bytes."""
    a, t, bb, u = _pair(b)
    h, _ = _read(b, bb, u, t)
    _finish(b, bb, h)
    t.fill_(42)
    bb.transfer(h)
    return [_finish(b, bb, h), b.same(t, u)]


@case("nixlRepostActiveError")
def repost_active_handle(b: Backend):
    """Reposting a READ whose state nobody has checked yet is REPOST_ACTIVE."""
    a, t, bb, u = _pair(b)
    h, first = _read(b, bb, u, t)
    if first == "DONE":
        return "completed at post"
    return observe(lambda: bb.transfer(h))


@case(["nixlNotFoundError", "KeyError"])
def unknown_peer_or_operation(b: Backend):
    """Fact 20: an unknown remote agent is NOT_FOUND; an unknown operation string is a KeyError."""
    a, t, bb, u = _pair(b)
    return [
        observe(lambda: bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, t), "X")),
        observe(lambda: bb.initialize_xfer("MOVE", b.descs(bb, u), b.descs(bb, t), "A")),
    ]


@case(["nixlNotFoundError"] * 4)
def descriptor_outside_registration(b: Backend):
    """Fact 20: a local or remote descriptor outside every registration (even 4 B past the end) is NOT_FOUND at
    creation and at preparation."""
    a, t, bb, u = _pair(b)
    past = b.xd(t, offset=4, length=N)
    loc_past = b.xd(u, offset=4, length=N)
    return [
        observe(lambda: bb.initialize_xfer("READ", b.descs(bb, u), bb.get_xfer_descs(past, b.memory), "A")),
        observe(lambda: bb.initialize_xfer("READ", bb.get_xfer_descs(loc_past, b.memory), b.descs(bb, t), "A")),
        observe(lambda: bb.prep_xfer_dlist("A", past, b.memory)),
        observe(lambda: bb.prep_xfer_dlist("NIXL_INIT_AGENT", loc_past, b.memory)),
    ]


@case(["RuntimeError"] * 4 + ["ok", "TypeError"] + ["ValueError"] * 3 + [2**64 - 8, "RuntimeError", "TypeError"])
def descriptor_numbers_as_the_bindings_cast_them(b: Backend):
    """Facts 5 and 20: addresses, lengths and devices are uint64 to pybind11: a float (a stride computed with `/`),
    a negative number or one past 2^64 is a RuntimeError, numpy integers are fine; a tuple of tuples is no list;
    numpy lists must be 64-bit integers in C order, and a negative int64 reads back as uint64; a meta that is no
    string or bytes is refused at registration."""
    a, t = b.agent("A"), b.buf(N)
    base, mem = t.data_ptr(), b.memory
    xfer = a.get_xfer_descs
    wide = np.array([[base, 8, 0, 1], [base + 8, 8, 0, 1]], dtype=np.uint64)
    return [
        observe(lambda: xfer([(base, N / 4, 0)], mem)),
        observe(lambda: xfer([(base, -8, 0)], mem)),
        observe(lambda: xfer([(base, 8, -1)], mem)),
        observe(lambda: xfer([(2**64, 8, 0)], mem)),
        observe(lambda: xfer([(np.uint64(base), np.int32(8), np.int64(0))], mem) and "ok"),
        observe(lambda: xfer(((base, 8, 0), (base + 8, 8, 0)), mem)),
        observe(lambda: xfer(np.array([[5, 8, 0]], dtype=np.int32), mem)),
        observe(lambda: xfer(np.array([[5, 8, 0]], dtype=np.float64), mem)),
        observe(lambda: xfer(wide[:, :3], mem)),
        observe(lambda: xfer(np.array([[5, -8, 0]], dtype=np.int64), mem)[0][1]),
        observe(lambda: a.register_memory([(base, 8, 0, 5)], mem)),
        observe(lambda: a.register_memory(((base, 8, 0, ""),), mem)),
    ]


@case(["nixlInvalidParamError", "nixlInvalidParamError"])
def length_or_count_mismatch(b: Backend):
    """Fact 20: different lengths or descriptor counts are INVALID_PARAM."""
    a, t, bb, u = _pair(b)
    two = b.xd(t, 0, N // 2) + b.xd(t, N // 2, N // 2)
    return [
        observe(
            lambda: bb.initialize_xfer("READ", b.descs(bb, u), bb.get_xfer_descs(b.xd(t, 0, N // 2), b.memory), "A")
        ),
        observe(lambda: bb.initialize_xfer("READ", b.descs(bb, u), bb.get_xfer_descs(two, b.memory), "A")),
    ]


@case(["DONE", "DONE", True])
def zero_length_and_loopback(b: Backend):
    """Fact 20: a zero-length descriptor is fine; a transfer to one's own name (loopback) moves bytes."""
    a, t = b.agent("A"), b.buf(N, 4)
    u = b.buf(N)
    b.reg(a, t)
    b.reg(a, u)
    z = a.initialize_xfer(
        "READ", a.get_xfer_descs(b.xd(u, 0, 0), b.memory), a.get_xfer_descs(b.xd(t, 0, 0), b.memory), "A"
    )
    a.transfer(z)
    h = a.initialize_xfer("READ", b.descs(a, u), b.descs(a, t), "A")
    a.transfer(h)
    return [_finish(b, a, z), _finish(b, a, h), b.same(t, u)]


@case(["nixlInvalidParamError"] * 5)
def prepped_bad_indices(b: Backend):
    """Fact 21: out-of-range, negative or empty indices, a count mismatch and swapped sides are INVALID_PARAM."""
    a, t, bb, u = _pair(b)
    local = bb.prep_xfer_dlist("NIXL_INIT_AGENT", b.xd(u), b.memory)
    remote = bb.prep_xfer_dlist("A", b.xd(t), b.memory)
    mk = bb.make_prepped_xfer
    return [
        observe(lambda: mk("READ", local, [1], remote, [0])),
        observe(lambda: mk("READ", local, [-1], remote, [0])),
        observe(lambda: mk("READ", local, [], remote, [])),
        observe(lambda: mk("READ", local, [0, 0], remote, [0])),
        observe(lambda: mk("READ", remote, [0], local, [0])),
    ]


@case(["RuntimeError"] * 4 + ["ValueError", "DONE"])
def prepped_index_types(b: Backend):
    """Observed on 1.5.1: indices are cast to C++ ints: a tensor, floats, None or a value past 2**31 do not cast
    (RuntimeError), a 2-D numpy array is refused, a float numpy array is cast."""
    import torch

    a, t, bb, u = _pair(b)
    local = bb.prep_xfer_dlist("NIXL_INIT_AGENT", b.descs(bb, u))
    remote = bb.prep_xfer_dlist("A", b.descs(bb, t))
    out = [
        observe(lambda: bb.make_prepped_xfer("READ", local, idx, remote, [0]))
        for idx in (torch.tensor([0]), [0.0], None, [2**40], np.zeros((1, 1), dtype=np.int64))
    ]
    h = bb.make_prepped_xfer("READ", local, np.array([0.0]), remote, np.array([0.0]))
    bb.transfer(h)
    out.append(_finish(b, bb, h))
    return out


@case(["DONE", "nixlInvalidParamError"])
def released_dlists(b: Backend):
    """Fact 21-22: a request made before its dlists were released still posts; making one afterwards fails."""
    a, t, bb, u = _pair(b)
    local = bb.prep_xfer_dlist("NIXL_INIT_AGENT", b.xd(u), b.memory)
    remote = bb.prep_xfer_dlist("A", b.xd(t), b.memory)
    h = bb.make_prepped_xfer("READ", local, [0], remote, [0])
    bb.release_dlist_handle(local)
    bb.release_dlist_handle(remote)
    bb.transfer(h)
    return [_finish(b, bb, h), observe(lambda: bb.make_prepped_xfer("READ", local, [0], remote, [0]))]


@case([None, None, "DONE"], hardened=[None, None, "nixlInvalidParamError"])
def release_twice_then_check(b: Backend):
    """Fact 22: a second release is a silent no-op; checking a released handle reads a stale DONE (stricter
    profiles raise instead)."""
    a, t, bb, u = _pair(b)
    h, _ = _read(b, bb, u, t)
    _finish(b, bb, h)
    return [
        observe(lambda: bb.release_xfer_handle(h)),
        observe(lambda: bb.release_xfer_handle(h)),
        observe(lambda: bb.check_xfer_state(h)),
    ]


@case("SIGSEGV", isolate=True, hardened="nixlInvalidParamError")
def post_released_handle(b: Backend):
    """Fact 22: posting a released request kills the process in 1.5.1 (also on H200 VRAM); the fake raises
    instead in every profile but dram."""
    a, t, bb, u = _pair(b)
    h, _ = _read(b, bb, u, t)
    _finish(b, bb, h)
    h.release()
    return observe(lambda: bb.transfer(h))


@case(["DONE", True, "nixlNotFoundError"], rdma=["nixlBackendError", False, "nixlNotFoundError"])
def local_deregister_then_post(b: Backend):
    """Fact 23: after the initiator deregisters its buffer an existing handle still posts (cma); a new request
    is NOT_FOUND.  rdma: the stale local key fails the post."""
    a, t, bb, u = _pair(b)
    h, _ = _read(b, bb, u, t)
    _finish(b, bb, h)
    u.zero_()
    bb.deregister_memory(bb.get_reg_descs(b.rd(u), b.memory))
    posted = observe(lambda: bb.transfer(h) and _finish(b, bb, h))
    return [posted, b.same(t, u), observe(lambda: bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, t), "A"))]


@case(["DONE", True], rdma=["nixlRemoteDisconnectError", False])
def target_deregister_then_post(b: Backend):
    """Fact 24: the target deregistering does not stop a peer's handle (no remote check on cma/NVLink)."""
    a, t, bb, u = _pair(b)
    h, _ = _read(b, bb, u, t)
    _finish(b, bb, h)
    u.zero_()
    a.deregister_memory(a.get_reg_descs(b.rd(t), b.memory))
    return [observe(lambda: bb.transfer(h) and _finish(b, bb, h)), b.same(t, u)]


@case("nixlRemoteDisconnectError", needs=("host-memory",))
def target_unmaps_memory(b: Backend):
    """Fact 25: the target deregisters and unmaps; the next post fails the endpoint with RemoteDisconnect."""
    a, bb, u = b.agent("A"), b.agent("B"), b.buf(N)
    m = b.mmap(N)
    a.register_memory(m.rd(), "DRAM")
    b.reg(bb, u)
    bb.add_remote_agent(a.get_agent_metadata())
    h = bb.initialize_xfer("READ", bb.get_xfer_descs(b.xd(u), b.memory), bb.get_xfer_descs(m.xd(), "DRAM"), "A")
    bb.transfer(h)
    _finish(b, bb, h)
    a.deregister_memory(a.get_reg_descs(m.rd(), "DRAM"))
    m.unmap()
    return observe(lambda: bb.transfer(h) and _finish(b, bb, h))


@case(["DONE", "DONE"], hardened=["DONE", "nixlNotFoundError"])
def recycled_address_new_extent(b: Backend):
    """The target re-registers an address with a shorter extent (an allocator recycled it); a peer's old handle
    still posts on 1.5.1 and reads whatever is there now.  The fake refuses it in every profile but dram."""
    a, t, bb, u = _pair(b)
    h, _ = _read(b, bb, u, t)
    first = _finish(b, bb, h)
    a.deregister_memory(a.get_reg_descs(b.rd(t), b.memory))
    b.reg(a, t, offset=0, length=N // 2)
    return [first, observe(lambda: bb.transfer(h) and _finish(b, bb, h))]


@case("nixlNotPostedError")
def check_before_post(b: Backend):
    """The state of a request that was never posted."""
    a, t, bb, u = _pair(b)
    h = bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, t), "A")
    return observe(lambda: bb.check_xfer_state(h))


@case([True, False, 2, True, True])
def handles_are_hashable_and_compare_by_identity(b: Backend):
    """Observed on 1.5.1: transfer and prepared-list handles are hashable (vLLM waits on a set of them) and equal
    only to themselves."""
    a, t = b.agent("A"), b.buf(N)
    b.reg(a, t)
    x = a.initialize_xfer("READ", b.descs(a, t), b.descs(a, t), "A")
    y = a.initialize_xfer("READ", b.descs(a, t), b.descs(a, t), "A")
    d = a.prep_xfer_dlist("NIXL_INIT_AGENT", b.descs(a, t))
    return [x == x, x == y, len({x, y, x}), d in {d}, d != x]


# -- peers ---------------------------------------------------------------------------------------------------
@case(["PROC", None, "nixlNotFoundError", "DONE", "nixlNotFoundError", False, None])
def remove_remote_agent(b: Backend):
    """Removing a peer invalidates handles towards it: a post is NOT_FOUND, a check of one in flight is NOT_FOUND,
    a DONE state stays DONE; removing an unknown name is silent."""
    a, t, bb, u = _pair(b)
    flying, first = _read(b, bb, u, t)  # the first READ on a new endpoint is PROC; nobody checks it
    done, _ = _read(b, bb, u, t)
    _finish(b, bb, done)
    return [
        first,
        observe(lambda: bb.remove_remote_agent("A")),
        observe(lambda: bb.transfer(done)),
        observe(lambda: bb.check_xfer_state(done)),
        observe(lambda: bb.check_xfer_state(flying)),
        bb.check_remote_metadata("A"),
        observe(lambda: bb.remove_remote_agent("nobody")),
    ]


@case(["DONE", "nixlRemoteDisconnectError", "nixlRemoteDisconnectError", "nixlRemoteDisconnectError"])
def failed_post_becomes_the_state(b: Backend):
    """A repost that fails with RemoteDisconnect replaces the request's earlier DONE: every later check raises
    it (a client must never read DONE for a transfer that did not happen)."""
    a, t, bb, u = _pair(b)
    h, _ = _read(b, bb, u, t)
    first = _finish(b, bb, h)
    del a
    b.collect()
    return [
        first,
        observe(lambda: bb.transfer(h)),
        observe(lambda: bb.check_xfer_state(h)),
        observe(lambda: bb.check_xfer_state(h)),
    ]


@case(["nixlNotFoundError", "nixlNotPostedError"])
def never_posted_towards_removed_peer(b: Backend):
    """A request that never got posted (its peer was removed first) reads NOT_POSTED, not NOT_FOUND."""
    a, t, bb, u = _pair(b)
    h = bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, t), "A")
    bb.remove_remote_agent("A")
    return [observe(lambda: bb.transfer(h)), observe(lambda: bb.check_xfer_state(h))]


@case(["A", "nixlNotFoundError", "DONE"])
def remove_and_readd(b: Backend):
    """Fact 26: after remove + add, new handles work and the old ones stay NOT_FOUND."""
    a, t, bb, u = _pair(b)
    old, _ = _read(b, bb, u, t)
    _finish(b, bb, old)
    bb.remove_remote_agent("A")
    name = bb.add_remote_agent(a.get_agent_metadata()).decode()
    h, _ = _read(b, bb, u, t)
    return [name, observe(lambda: bb.transfer(old)), _finish(b, bb, h)]


@case(
    [
        True,
        "nixlRemoteDisconnectError",
        "nixlRemoteDisconnectError",
        None,
        "nixlRemoteDisconnectError",
        "nixlNotAllowedError",
        "A",
        "nixlNotFoundError",
        "DONE",
    ]
)
def destroyed_peer(b: Backend):
    """Fact 26: a destroyed peer stays known (check True), posts and notifs raise RemoteDisconnect, new requests can
    still be made; a new agent under its name is NOT_ALLOWED until it is removed; old handles are then NOT_FOUND."""
    a, t, bb, u = _pair(b)
    h, _ = _read(b, bb, u, t)
    _finish(b, bb, h)
    del a
    b.collect()
    known = bb.check_remote_metadata("A")
    post = observe(lambda: bb.transfer(h))
    notif = observe(lambda: bb.send_notif("A", b"x"))
    made = observe(lambda: bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, t), "A") and None)
    post_new = observe(lambda: bb.transfer(bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, t), "A")))
    a2 = b.agent("A")
    b.reg(a2, t)
    readd = observe(lambda: bb.add_remote_agent(a2.get_agent_metadata()))
    bb.remove_remote_agent("A")
    name = bb.add_remote_agent(a2.get_agent_metadata()).decode()
    h2, _ = _read(b, bb, u, t)
    return [known, post, notif, made, post_new, readd, name, observe(lambda: bb.transfer(h)), _finish(b, bb, h2)]


@case(["DONE", "nixlRemoteDisconnectError"])
def handle_keeps_agent_alive(b: Backend):
    """Fact 27: dropping the Python agent while one of its handles lives keeps the C++ agent (peers still read
    from it); dropping the handle destroys it."""
    a, t, bb, u = _pair(b)
    keep = a.prep_xfer_dlist("NIXL_INIT_AGENT", b.xd(t), b.memory)
    h, _ = _read(b, bb, u, t)
    _finish(b, bb, h)
    del a
    b.collect()
    alive = observe(lambda: bb.transfer(h) and _finish(b, bb, h))
    del keep
    b.collect()
    return [alive, observe(lambda: bb.transfer(h) and _finish(b, bb, h))]


@case(["PROC", "nixlRemoteDisconnectError", "nixlRemoteDisconnectError"], transport="tcp")
def target_destroyed_in_flight(b: Backend):
    """Fact 26 (tcp): a READ still in flight (the first one on a new connection) when its target is destroyed
    raises RemoteDisconnect at the next check, and keeps raising it."""
    # Long enough over tcp to outlast the destructor (~0.1 s): 512 MiB once finished first on a 2-core CI machine.
    a, t, bb, u = _pair(b, 1 << 30)
    h, first = _read(b, bb, u, t)
    del a
    b.collect()
    return [
        first,
        observe(lambda: b.wait(lambda: bb.check_xfer_state(h) == "DONE")),
        observe(lambda: bb.check_xfer_state(h)),
    ]


@case(["nixlBackendError", False, "nixlNotFoundError", "nixlBackendError"])
def peer_gone_before_load(b: Backend):
    """Observed on 1.5.1: metadata of an agent that is already gone cannot be loaded (UCX connects while loading:
    connection refused), the peer stays unknown, and a retry fails the same way."""
    a, t = b.agent("A"), b.buf(N, PATTERN)
    b.reg(a, t)
    md = a.get_agent_metadata()
    del a
    b.collect()
    bb, u = b.agent("B"), b.buf(N)
    b.reg(bb, u)
    return [
        observe(lambda: bb.add_remote_agent(md)),
        bb.check_remote_metadata("A"),
        observe(lambda: bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, t), "A")),
        observe(lambda: bb.add_remote_agent(md)),
    ]


@case([True, False, {"A": ["to me"]}, None, True])
def own_name(b: Backend):
    """Observed on 1.5.1: an agent knows its own name (with no descriptors to check), takes a notification to
    itself, and removing itself is a silent success."""
    a, t = b.agent("A"), b.buf(N)
    b.reg(a, t)
    out = [a.check_remote_metadata("A"), a.check_remote_metadata("A", b.descs(a, t))]
    a.send_notif("A", b"to me")
    got = b.wait(a.get_new_notifs)
    out.append({k: [m.decode() for m in v] for k, v in got.items()})
    out += [observe(lambda: a.remove_remote_agent("A")), a.check_remote_metadata("A")]
    return out


@case(["bytes", None, "DONE", True, "DONE", True, {"B": ["n"]}, [True, True, True], None, False, "nixlNotFoundError"])
def name_as_bytes(b: Backend):
    """Observed on 1.5.1: every call that takes a remote agent name takes the bytes that add_remote_agent returned
    (and a bytearray): pybind11 converts both to the std::string name.  make_connection, a prepared READ, a READ
    through initialize_xfer, send_notif and check_remote_metadata work with it, and remove_remote_agent with it
    removes the peer."""
    a, t = b.agent("A"), b.buf(N, PATTERN)
    bb, u = b.agent("B"), b.buf(N, 0)
    b.reg(a, t)
    b.reg(bb, u)
    name = bb.add_remote_agent(a.get_agent_metadata())
    out = [type(name).__name__, observe(lambda: bb.make_connection(name))]
    local = bb.prep_xfer_dlist("NIXL_INIT_AGENT", b.descs(bb, u))
    remote = bb.prep_xfer_dlist(name, b.descs(bb, t))
    h = bb.make_prepped_xfer("READ", local, [0], remote, [0])
    bb.transfer(h)
    out += [_finish(b, bb, h), b.same(t, u)]
    u.zero_()
    h2, _ = _read(b, bb, u, t, remote=name)
    out += [_finish(b, bb, h2), b.same(t, u)]
    bb.send_notif(name, b"n")
    out.append({k: [m.decode() for m in v] for k, v in b.wait(a.get_new_notifs).items()})
    out.append(
        [
            bb.check_remote_metadata(name),
            bb.check_remote_metadata(bytearray(name)),
            bb.check_remote_metadata(name, b.descs(bb, t)),
        ]
    )
    out += [
        observe(lambda: bb.remove_remote_agent(name)),
        bb.check_remote_metadata("A"),
        observe(lambda: bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, t), "A")),
    ]
    return out


@case([[["TypeError"] * 7] * 4, True, ["ok", "nixlNotFoundError"], "DONE", True, ["C", "TypeError"]])
def agent_name_types(b: Backend):
    """Observed on 1.5.1: a name that is neither str nor bytes (None, an int, a memoryview), or a str with no UTF-8
    form, is pybind11's TypeError in every call that takes a remote agent name (and removes nothing).  As bytes,
    b"" prepares a local list as "" does, b"NIXL_INIT_AGENT" does not (no such peer), the agent's own name is a
    loopback, and a new agent may be named with bytes; None is no name."""
    a, t, bb, u = _pair(b)
    refused = []
    for bad in (None, 7, memoryview(b"A"), "\udcffA"):
        refused.append(
            [
                observe(lambda: bb.make_connection(bad)),
                observe(lambda: bb.prep_xfer_dlist(bad, b.descs(bb, t))),
                observe(lambda: bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, t), bad)),
                observe(lambda: bb.send_notif(bad, b"x")),
                observe(lambda: bb.check_remote_metadata(bad)),
                observe(lambda: bb.remove_remote_agent(bad)),
                observe(lambda: bb.fetch_remote_metadata(bad)),
            ]
        )
    local = [
        observe(lambda: bb.prep_xfer_dlist(b"", b.descs(bb, u)) and "ok"),
        observe(lambda: bb.prep_xfer_dlist(b"NIXL_INIT_AGENT", b.descs(bb, u))),
    ]
    v = b.buf(N, 3)
    b.reg(bb, v)
    loop = bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, v), b"B")
    bb.transfer(loop)
    c = b.agent(b"C")
    return [
        refused,
        bb.check_remote_metadata("A"),
        local,
        _finish(b, bb, loop),
        b.same(u, v),
        [bb.add_remote_agent(c.get_agent_metadata()).decode(), observe(lambda: b.agent(None))],
    ]


@case(["nixlNotFoundError", "A", "nixlNotFoundError", "DONE"])
def remove_peer_under_a_prepared_list(b: Backend):
    """Observed on 1.5.1: a remote list prepared before its peer was removed makes no request (NOT_FOUND at
    make_prepped_xfer), nor after the peer is added again; a list prepared afterwards works."""
    a, t, bb, u = _pair(b)
    local = bb.prep_xfer_dlist("NIXL_INIT_AGENT", b.descs(bb, u))
    remote = bb.prep_xfer_dlist("A", b.descs(bb, t))
    bb.remove_remote_agent("A")
    out = [observe(lambda: bb.make_prepped_xfer("READ", local, [0], remote, [0]))]
    out.append(bb.add_remote_agent(a.get_agent_metadata()).decode())
    out.append(observe(lambda: bb.make_prepped_xfer("READ", local, [0], remote, [0])))
    fresh = bb.prep_xfer_dlist("A", b.descs(bb, t))
    h = bb.make_prepped_xfer("READ", local, [0], fresh, [0])
    bb.transfer(h)
    out.append(_finish(b, bb, h))
    return out


# -- two processes -------------------------------------------------------------------------------------------
@case(["A", "DONE", True, "B"])
def two_process_read(b: Backend):
    """Two OS processes: each loads the other's metadata; the peer READs our buffer and the parent reads its."""
    p = b.peer("A")
    try:
        bb, u = b.agent("B"), b.buf(p.nbytes, 0)
        b.reg(bb, u)
        name = bb.add_remote_agent(p.md).decode()
        h = bb.initialize_xfer("READ", b.descs(bb, u), bb.get_xfer_descs([(p.addr, p.nbytes, 0)], "DRAM"), "A")
        bb.transfer(h)
        done = _finish(b, bb, h)
        added = p.call("add", bb.get_agent_metadata())
        return [name, done, bool((u.cpu() == PATTERN).all()), added.decode() if isinstance(added, bytes) else added]
    finally:
        p.close()


@case(
    [True, "nixlRemoteDisconnectError", "nixlRemoteDisconnectError", True, "nixlNotAllowedError", "A", "DONE"],
    transport="tcp",
)
def kill_target_mid_read(b: Backend):
    """Fact 30 (tcp): SIGKILL the target during a READ: the next check raises RemoteDisconnect, later posts too, the
    peer stays known; a restarted target under the same name is NOT_ALLOWED until removed, then works."""
    p = b.peer("A", 256 << 20)  # large enough that the READ is still in flight when the kill lands
    bb, u = b.agent("B"), b.buf(p.nbytes, 0)
    b.reg(bb, u)
    bb.add_remote_agent(p.md)
    h = bb.initialize_xfer("READ", b.descs(bb, u), bb.get_xfer_descs([(p.addr, p.nbytes, 0)], "DRAM"), "A")
    state = bb.transfer(h)
    p.kill()
    seen = observe(lambda: b.wait(lambda: bb.check_xfer_state(h) == "DONE", tries=50))
    out = [state == "PROC", seen, observe(lambda: bb.transfer(h)), bb.check_remote_metadata("A")]
    p2 = b.peer("A", 256 << 20)
    try:
        out.append(observe(lambda: bb.add_remote_agent(p2.md)))
        bb.remove_remote_agent("A")
        out.append(bb.add_remote_agent(p2.md).decode())
        h2 = bb.initialize_xfer("READ", b.descs(bb, u), bb.get_xfer_descs([(p2.addr, p2.nbytes, 0)], "DRAM"), "A")
        bb.transfer(h2)
        out.append(_finish(b, bb, h2))
    finally:
        p2.close()
    return out


@case([{"B": ["hello"]}, "nixlRemoteDisconnectError", True])
def kill_initiator(b: Backend):
    """Fact 31: the initiator dies; the target is not told: its notif to the dead peer raises RemoteDisconnect and
    check_remote_metadata stays True."""
    a, t = b.agent("A"), b.buf(N, PATTERN)
    b.reg(a, t)
    p = b.peer("B")
    a.add_remote_agent(p.md)
    p.call("add", a.get_agent_metadata())
    p.call("notif", "A", b"hello")
    got = b.wait(a.get_new_notifs)
    p.kill()
    b.wait(lambda: False, tries=5)
    return [
        {k: [m.decode() for m in v] for k, v in got.items()},
        observe(lambda: a.send_notif("B", b"x")),
        a.check_remote_metadata("B"),
    ]


# -- the rest of the package: what NIXL's own Python tests use ------------------------------------------------
@case([[0xBA] * 4, None, None])
def utils_helpers(b: Backend):
    """nixl._utils: malloc_passthru gives writable memory, ba_buf fills it with 0xba, and verify_transfer returns
    None whether the two ranges match or not (its check is a C assert, compiled out of the wheel)."""
    import ctypes

    n = 64
    x, y = b.utils.malloc_passthru(n), b.utils.malloc_passthru(n)
    try:
        b.utils.ba_buf(x, n)
        b.utils.ba_buf(y, n)
        same = b.utils.verify_transfer(x, y, n)
        ctypes.memset(y, 7, n)
        return [list(ctypes.string_at(x, 4)), same, b.utils.verify_transfer(x, y, n)]
    finally:
        b.utils.free_passthru(x)
        b.utils.free_passthru(y)


@case(["nixl.api", "nixl.nixl.a", False])
def logging_names(b: Backend):
    """nixl.logging: get_logger(name) is nixl.<name without leading underscores>, whatever name is; the nixl
    logger does not propagate."""
    import logging

    return [
        b.nixl_logging.get_logger("_api").name,
        b.nixl_logging.get_logger("nixl.a").name,
        logging.getLogger("nixl").propagate,
    ]


def _telemetry(b: Backend, env: str | None, capture: bool):
    """A READ by an agent made with NIXL_TELEMETRY_ENABLE=env (unset: None) and capture_telemetry; its telemetry,
    or what was raised."""
    import os

    a, t = b.agent("A"), b.buf(N, PATTERN)
    saved = os.environ.get("NIXL_TELEMETRY_ENABLE")
    if env is None:
        os.environ.pop("NIXL_TELEMETRY_ENABLE", None)
    else:
        os.environ["NIXL_TELEMETRY_ENABLE"] = env
    try:
        made = observe(lambda: b.agent("B", capture_telemetry=capture))
        if isinstance(made, str):
            return made
        bb, u = made, b.buf(N, 0)
    finally:
        if saved is None:
            os.environ.pop("NIXL_TELEMETRY_ENABLE", None)
        else:
            os.environ["NIXL_TELEMETRY_ENABLE"] = saved
    b.reg(a, t)
    b.reg(bb, u)
    bb.add_remote_agent(a.get_agent_metadata())
    h = bb.initialize_xfer("READ", b.descs(bb, u), b.descs(bb, t), "A")
    bb.transfer(h)
    _finish(b, bb, h)
    got = observe(lambda: bb.get_xfer_telemetry(h))
    if isinstance(got, str):
        return got
    return [
        got.descCount,
        got.totalBytes,
        got.startTime > 0,
        got.postDuration > 0,
        got.xferDuration >= got.postDuration,
    ]


@case(
    ["nixlNoTelemetryError", [1, N, True, True, True], [1, N, True, True, True], "nixlNoTelemetryError", "RuntimeError"]
)
def telemetry_switches(b: Backend):
    """Transfer telemetry: the config's capture_telemetry decides while NIXL_TELEMETRY_ENABLE is unset; set, the
    variable decides either way (y/yes/on/1/true/enable, n/no/off/0/false/disable, any case; no sink needed), and
    another value fails the agent's construction.  Times are microseconds, the transfer's no shorter than its post."""
    return [
        _telemetry(b, None, False),
        _telemetry(b, None, True),
        _telemetry(b, "y", False),
        _telemetry(b, "No", True),
        _telemetry(b, "bogus", True),
    ]


@case(["NIXL_SUCCESS", "NIXL_SUCCESS"])
def status_returns(b: Backend):
    """The bindings' registerMem and deregisterMem return NIXL_SUCCESS (nixl_status_t), not None."""
    a, t = b.agent("A"), b.buf(N)
    core, ucx = a.agent, a.backends["UCX"]
    descs = a.get_reg_descs(t)
    return [core.registerMem(descs, [ucx]).name, core.deregisterMem(descs, [ucx]).name]


@case(
    [
        True,
        {
            "use_posix_aio": "false",
            "use_uring": "false",
            "use_aio": "false",
            "kernel_queue_size": "256",
            "ios_pool_size": "65536",
        },
        ["DRAM_SEG", "FILE_SEG"],
        [["mode", "mtime", "size"], True, "11"],
        "nixlNotSupportedError",
    ]
)
def posix_query_mem(b: Backend):
    """The POSIX plugin: its parameters, and queryMem on a list of files (size, mode and modification time as
    strings; None for one that does not exist); UCX does not answer queryMem."""
    import os
    import tempfile

    a = b.agent("A")
    core = a.agent
    params, mems = core.getPluginParams("POSIX")
    posix = core.createBackend("POSIX", params)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f")
        with open(path, "wb") as f:
            f.write(b"hello world")
        files = b.bindings.nixlRegDList(b.bindings.FILE_SEG)
        files.addDesc((0, 0, 0, path))
        files.addDesc((0, 0, 0, os.path.join(d, "missing")))
        got = core.queryMem(files, posix)
        by_ucx = observe(lambda: core.queryMem(files, a.backends["UCX"]))
    return ["POSIX" in core.getAvailPlugins(), params, mems, [sorted(got[0]), got[1] is None, got[0]["size"]], by_ucx]


# -- overlapping registrations ------------------------------------------------------------------------------
K4 = 4096
OVERLAPS = {
    "identical": ((0, 2 * K4), (0, 2 * K4)),
    "nested": ((0, 4 * K4), (K4, K4)),
    "partial": ((0, 2 * K4), (K4, 2 * K4)),
    "adjacent": ((0, 2 * K4), (2 * K4, 2 * K4)),
    "same_start": ((0, K4), (0, 4 * K4)),
}


def _overlap_ranges(shape: str) -> list[tuple[int, int]]:
    """(offset, length) of READs at every part of two registrations: inside each stretch between their edges,
    across each inner edge, and over their union."""
    (o1, n1), (o2, n2) = OVERLAPS[shape]
    cuts = sorted({o1, o1 + n1, o2, o2 + n2})
    stretches = list(zip(cuts, cuts[1:]))
    ranges = [(a + (b - a) // 2 - 128, 256) for a, b in stretches]
    ranges += [(b - 128, 256) for _, b in stretches[:-1]]
    lo, hi = min(o1, o2), max(o1 + n1, o2 + n2)
    return ranges + [(lo, hi - lo)]


def _overlap_reads(b: Backend, shape: str, where: str, release: str, two_agents: bool = False) -> str:
    """Registrations R1 and R2 of OVERLAPS[shape] over one 16 KiB buffer of the target (``where`` remote) or the
    initiator (local), by the agent that moves the bytes (or R2 by a third agent of the process), R1 or R2 then
    released (or neither); a READ at every range of :func:`_overlap_ranges`: D (done) or N (NOT_FOUND) each."""
    (o1, n1), (o2, n2) = OVERLAPS[shape]
    t, u = b.buf(4 * K4, PATTERN), b.buf(4 * K4, 0)
    tgt, ini = b.agent("T"), b.agent("I")
    owner, buf = (tgt, t) if where == "remote" else (ini, u)
    other = b.agent("O") if two_agents else owner
    base = buf.data_ptr()
    d1 = owner.get_reg_descs([(base + o1, n1, b.dev(buf), "")], mem_type=b.memory)
    d2 = other.get_reg_descs([(base + o2, n2, b.dev(buf), "")], mem_type=b.memory)
    owner.register_memory(d1)
    other.register_memory(d2)
    b.reg(ini if where == "remote" else tgt, u if where == "remote" else t)
    if release == "r1":
        owner.deregister_memory(d1)
    elif release == "r2":
        other.deregister_memory(d2)
    ini.add_remote_agent(tgt.get_agent_metadata())
    out = ""
    for off, n in _overlap_ranges(shape):
        local = (u.data_ptr() + (off if where == "local" else 0), n, b.dev(u))
        remote = (t.data_ptr() + (off if where == "remote" else 0), n, b.dev(t))

        def read():
            h = ini.initialize_xfer(
                "READ",
                ini.get_xfer_descs([local], mem_type=b.memory),
                ini.get_xfer_descs([remote], mem_type=b.memory),
                "T",
            )
            ini.transfer(h)
            state = _finish(b, ini, h)
            ini.release_xfer_handle(h)
            return state

        got = observe(read)
        out += {"DONE": "D", "nixlNotFoundError": "N"}.get(got, f"[{got}]")
    return out


def _overlap_case(shape: str) -> Callable[[Backend], dict[str, str]]:
    def run(b: Backend) -> dict[str, str]:
        got = {f"{w}/{r}": _overlap_reads(b, shape, w, r) for w in ("remote", "local") for r in ("none", "r1", "r2")}
        got["remote, R2 by another agent"] = _overlap_reads(b, shape, "remote", "none", two_agents=True)
        return got

    return run


def _expect(none: str, r1: str, r2: str, other: str) -> dict[str, str]:
    rows = {f"{w}/{k}": v for w in ("remote", "local") for k, v in (("none", none), ("r1", r1), ("r2", r2))}
    return {**rows, "remote, R2 by another agent": other}


# NIXL 1.5.1 looks a range up in the registration that starts last at or before it and takes it only if that one
# holds the whole range: a READ in the part of an outer registration past a nested one is NOT_FOUND, a range across
# adjacent registrations is NOT_FOUND, one across a partial overlap is found where the later-starting one holds it.
# Of two starting together the longer is taken.  Releasing one of two identical registrations keeps the other;
# another agent's registration changes nothing.  rocm-strict refuses a second registration of the same bytes.
for _shape, _want in {
    "identical": _expect("DD", "DD", "DD", "DD"),
    "nested": _expect("DDNDND", "NDNNNN", "DDDDDD", "DDDDDD"),
    "partial": _expect("DDDDDN", "NDDNDN", "DDNDNN", "DDNDNN"),
    "adjacent": _expect("DDNN", "NDNN", "DNNN", "DNNN"),
    "same_start": _expect("DDDD", "DDDD", "DNNN", "DNNN"),
}.items():
    _fn = _overlap_case(_shape)
    _fn.__name__ = f"overlapping_registrations_{_shape}"
    _fn.__doc__ = (
        f"Two registrations {_shape} over one buffer (R1, R2 = {OVERLAPS[_shape]}), on the target and on "
        "the initiator, each released in turn: a READ at every part of them (D done, N NOT_FOUND)."
    )
    if _shape == "adjacent":
        case(_want)(_fn)
    else:
        case(_want, rocm_strict="nixlBackendError")(_fn)
