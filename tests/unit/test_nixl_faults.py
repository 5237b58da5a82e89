"""Fault sites of the fake NIXL (``fakes/nixl/_faults.py``): each one fires where it says, as often as it says.

Every test builds its own :class:`FakeFabric` and creates agents inside ``use_fabric``, so nothing here touches the
process-wide default fabric.  Outside a simulator the fabric's time is a tick counter advanced by every agent call;
the tests that count state checks therefore make no other agent call between the post and the checks.
"""

from __future__ import annotations

import pytest
import torch

from fakes.nixl import FakeFabric, _api, _bindings, use_fabric
from fakes.nixl._faults import SITES, STATUS_BY_NAME, ArmedFault

N = 256
PATTERN = 7


class World:
    """Target ``A`` (buffer ``t`` full of PATTERN) and initiator ``B`` (buffer ``u`` zeroed); each knows the other."""

    def __init__(self, fabric: FakeFabric, n: int = N, extra: tuple[str, ...] = ()) -> None:
        self.fabric = fabric
        with use_fabric(fabric):
            self.a = _api.nixl_agent("A")
            self.b = _api.nixl_agent("B")
            self.others = {name: _api.nixl_agent(name) for name in extra}
        self.t = torch.full((n,), PATTERN, dtype=torch.uint8)
        self.u = torch.zeros(n, dtype=torch.uint8)
        self.a.register_memory(self.t)
        self.b.register_memory(self.u)
        self.b.add_remote_agent(self.a.get_agent_metadata())
        self.a.add_remote_agent(self.b.get_agent_metadata())
        # Keep every registered buffer alive as long as the world: the fake copies with memmove, like cma does.
        self.bufs = {name: torch.zeros(n, dtype=torch.uint8) for name in extra}
        for name, other in self.others.items():
            other.register_memory(self.bufs[name])
            other.add_remote_agent(self.b.get_agent_metadata())
            self.b.add_remote_agent(other.get_agent_metadata())

    def wire(self) -> "World":
        """Connect B's endpoints (a first transfer towards a peer waits for the wire-up, READ or WRITE alike), so
        that a later WRITE completes at post; B's buffer is zeroed again afterwards."""
        for name, buf in [("A", self.t), *((n, self.bufs[n]) for n in self.others)]:
            h = self.b.initialize_xfer("READ", self.b.get_xfer_descs(self.u), self.b.get_xfer_descs(buf), name)
            checks_until_done(self.b, h, self.b.transfer(h))
            h.release()
        self.u.zero_()
        return self

    def read(self, notif: bytes = b""):
        """B READs A's buffer into its own."""
        return self.b.initialize_xfer("READ", self.b.get_xfer_descs(self.u), self.b.get_xfer_descs(self.t), "A", notif)

    def write(self, notif: bytes = b""):
        """B WRITEs its (zeroed) buffer over A's."""
        return self.b.initialize_xfer("WRITE", self.b.get_xfer_descs(self.u), self.b.get_xfer_descs(self.t), "A", notif)

    def moved(self) -> bool:
        return bool((self.u == self.t).all())


def world(profile: str = "dram", **kw) -> World:
    extra = kw.pop("extra", ())
    return World(FakeFabric(profile, **kw), extra=extra)


def checks_until_done(agent, handle, first: str, limit: int = 100) -> int:
    """How many check_xfer_state calls it takes to read DONE (0: transfer() already said DONE)."""
    if first == "DONE":
        return 0
    for k in range(1, limit + 1):
        if agent.check_xfer_state(handle) == "DONE":
            return k
    raise AssertionError(f"transfer not DONE after {limit} checks")


def all_notifs(agent, polls: int) -> list[list[bytes]]:
    """What ``agent`` receives from B on each of ``polls`` consecutive calls."""
    return [agent.get_new_notifs().get("B", []) for _ in range(polls)]


# -- arming --------------------------------------------------------------------------------------------------
def test_arm_unknown_site_names_the_known_sites():
    f = FakeFabric()
    with pytest.raises(LookupError) as info:
        f.faults.arm("xfer.nope")
    assert "xfer.nope" in str(info.value)
    for site in SITES:
        assert site in str(info.value)
    assert f.faults.armed == []


def test_arm_bad_error_name_names_the_statuses():
    f = FakeFabric()
    with pytest.raises(ValueError) as info:
        f.faults.arm("xfer.fail_after", polls=2, error="NIXL_ERR_BOGUS")
    assert "NIXL_ERR_BOGUS" in str(info.value)
    for name in STATUS_BY_NAME:
        assert name in str(info.value)
    assert f.faults.armed == []


def test_arm_returns_the_armed_fault_with_its_filter_and_params():
    f = FakeFabric()
    fault = f.faults.arm("xfer.late", agent="B", peer="A", times=2, delay=4)
    assert isinstance(fault, ArmedFault)
    assert (fault.site, fault.agent, fault.peer, fault.times, fault.params) == ("xfer.late", "B", "A", 2, {"delay": 4})
    assert fault.fired == 0
    assert f.faults.armed == [fault]
    assert "xfer.late" in repr(fault) and "delay=4" in repr(fault)


def test_a_fault_armed_for_one_process_trips_only_that_process_s_agents():
    """``pid=`` (the simulator's ``rank=``): agents of other processes register as if nothing were armed."""
    f = FakeFabric()
    other = f.spawn_process("other")
    with use_fabric(f):
        with f.process(other):
            b = _api.nixl_agent("B")
        a = _api.nixl_agent("A")
    fault = f.faults.arm("register.fail", pid=other)
    assert "pid=1" in repr(fault)
    a.register_memory(torch.zeros(8, dtype=torch.uint8))  # process 0: untouched
    assert fault.fired == 0
    with pytest.raises(_bindings.nixlBackendError):
        b.register_memory(torch.zeros(8, dtype=torch.uint8))
    assert fault.fired == 1 and [(site, agent) for site, agent, _, _ in f.faults.fired] == [("register.fail", "B")]


# -- register.fail -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "error, exc",
    [
        (None, _bindings.nixlBackendError),
        ("NOT_ALLOWED", _bindings.nixlNotAllowedError),
        ("NOT_FOUND", _bindings.nixlNotFoundError),
    ],
)
def test_register_fail_raises_configured_error_and_registers_nothing(error, exc):
    f = FakeFabric()
    with use_fabric(f):
        a = _api.nixl_agent("A")
    params = {} if error is None else {"error": error}
    fault = f.faults.arm("register.fail", **params)
    before = a.get_agent_metadata()
    t1, t2 = torch.ones(N, dtype=torch.uint8), torch.ones(N, dtype=torch.uint8)
    with pytest.raises(exc):
        a.register_memory([t1, t2])  # a batch: all or nothing
    assert a.agent.regions == []
    assert a.get_agent_metadata() == before
    assert fault.fired == 1
    assert [entry[:3] for entry in f.faults.fired] == [("register.fail", "A", None)]


def test_register_fail_times_one_then_registration_works():
    f = FakeFabric()
    with use_fabric(f):
        a, p = _api.nixl_agent("A"), _api.nixl_agent("P")
    fault = f.faults.arm("register.fail", times=1)
    t = torch.full((N,), PATTERN, dtype=torch.uint8)
    with pytest.raises(_bindings.nixlBackendError):
        a.register_memory(t)
    a.register_memory(t)  # the fault is spent
    a.register_memory(torch.zeros(N, dtype=torch.uint8))
    assert fault.fired == 1
    assert len(f.faults.fired) == 1
    assert len(a.agent.regions) == 2
    # and what was registered is really usable by a peer
    p.add_remote_agent(a.get_agent_metadata())
    assert p.check_remote_metadata("A", p.get_xfer_descs(t))


def test_register_fail_filters_by_agent_name():
    f = FakeFabric()
    with use_fabric(f):
        a, b = _api.nixl_agent("A"), _api.nixl_agent("B")
    fault = f.faults.arm("register.fail", agent="B", error="UNKNOWN")
    a.register_memory(torch.ones(N, dtype=torch.uint8))
    assert fault.fired == 0 and f.faults.fired == []
    with pytest.raises(_bindings.nixlUnknownError):
        b.register_memory(torch.ones(N, dtype=torch.uint8))
    a.register_memory(torch.ones(N, dtype=torch.uint8))
    assert len(a.agent.regions) == 2 and b.agent.regions == []
    assert fault.fired == 1
    assert [entry[:3] for entry in f.faults.fired] == [("register.fail", "B", None)]


# -- xfer.stuck ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_xfer_stuck_stays_proc_and_moves_no_data(op):
    w = world()
    fault = w.fabric.faults.arm("xfer.stuck", agent="B", peer="A")
    h = w.read() if op == "READ" else w.write()
    assert w.b.transfer(h) == "PROC"
    states = [w.b.check_xfer_state(h) for _ in range(200)]
    assert set(states) == {"PROC"}
    assert bool((w.u == 0).all()) and bool((w.t == PATTERN).all())  # no byte moved, in either direction
    assert fault.fired == 1
    with pytest.raises(_bindings.nixlRepostActiveError):
        w.b.transfer(h)  # still in flight as far as NIXL is concerned
    assert [entry[:3] for entry in w.fabric.faults.fired] == [("xfer.stuck", "B", "A")]


def test_xfer_stuck_filter_by_peer_leaves_other_peers_alone():
    w = world(extra=("C",))
    w.fabric.faults.arm("xfer.stuck", peer="C")
    h = w.read()
    assert checks_until_done(w.b, h, w.b.transfer(h)) <= 1
    assert w.moved()
    assert w.fabric.faults.fired == []


# -- xfer.fail_after -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("polls", [1, 3, 7])
@pytest.mark.parametrize(
    "error, exc",
    [
        (None, _bindings.nixlRemoteDisconnectError),
        ("CANCELED", _bindings.nixlCancelledError),
        ("BACKEND", _bindings.nixlBackendError),
    ],
)
def test_xfer_fail_after_raises_at_exactly_the_nth_check_and_keeps_raising(polls, error, exc):
    w = world()
    params = {"polls": polls} if error is None else {"polls": polls, "error": error}
    fault = w.fabric.faults.arm("xfer.fail_after", **params)
    h = w.read()
    assert w.b.transfer(h) == "PROC"
    for _ in range(polls - 1):
        assert w.b.check_xfer_state(h) == "PROC"
    for _ in range(5):  # the Nth check and every one after it
        with pytest.raises(exc):
            w.b.check_xfer_state(h)
    assert fault.fired == 1  # fired once, at post
    # The failed transfer never completes later either.
    for _ in range(50):
        w.a.get_new_notifs()
    assert bool((w.u == 0).all())
    with pytest.raises(exc):
        w.b.check_xfer_state(h)


def test_xfer_fail_after_preempts_completion_on_tcp():
    # tcp: a READ completes during the 3rd fabric call after its post; fail_after at the 3rd check still wins.
    w = world(transport="tcp")
    baseline = w.read()
    assert checks_until_done(w.b, baseline, w.b.transfer(baseline)) == 3
    w.fabric.faults.arm("xfer.fail_after", polls=3, error="REMOTE_DISCONNECT")
    h = w.read()
    assert w.b.transfer(h) == "PROC"
    assert [w.b.check_xfer_state(h) for _ in range(2)] == ["PROC", "PROC"]
    with pytest.raises(_bindings.nixlRemoteDisconnectError):
        w.b.check_xfer_state(h)


def test_xfer_fail_after_times_one_only_hits_the_first_post():
    w = world()
    fault = w.fabric.faults.arm("xfer.fail_after", polls=2, times=1)
    h1 = w.read()
    w.b.transfer(h1)
    assert w.b.check_xfer_state(h1) == "PROC"
    with pytest.raises(_bindings.nixlRemoteDisconnectError):
        w.b.check_xfer_state(h1)
    h2 = w.read()
    assert checks_until_done(w.b, h2, w.b.transfer(h2)) <= 1
    assert w.moved()
    assert fault.fired == 1


# -- xfer.late -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport, op, baseline", [("cma", "WRITE", 1), ("cma", "READ", 1), ("tcp", "READ", 3)])
@pytest.mark.parametrize("delay", [2, 5])
def test_xfer_late_completes_delay_checks_later(transport, op, baseline, delay):
    ref = world(transport=transport)
    h = ref.read() if op == "READ" else ref.write()
    assert checks_until_done(ref.b, h, ref.b.transfer(h)) == baseline

    w = world(transport=transport)
    fault = w.fabric.faults.arm("xfer.late", agent="B", delay=delay)
    h = w.read() if op == "READ" else w.write()
    first = w.b.transfer(h)
    assert first == "PROC"
    assert checks_until_done(w.b, h, first) == baseline + delay
    assert fault.fired == 1
    if op == "READ":
        assert w.moved()
    else:
        assert bool((w.t == 0).all())


def test_xfer_late_data_arrives_only_at_completion():
    w = world().wire()
    w.fabric.faults.arm("xfer.late", delay=4)
    h = w.write()
    assert w.b.transfer(h) == "PROC"
    assert bool((w.t == PATTERN).all())  # nothing written yet
    assert checks_until_done(w.b, h, "PROC") == 4
    assert bool((w.t == 0).all())


# -- notif.drop ----------------------------------------------------------------------------------------------
def test_unfaulted_notifs_arrive_on_the_next_call():
    w = world().wire()
    w.b.send_notif("A", b"hello")
    assert all_notifs(w.a, 1) == [[b"hello"]]
    h = w.write(b"tag")
    assert w.b.transfer(h) == "DONE"
    assert all_notifs(w.a, 1) == [[b"tag"]]


def test_notif_drop_standalone_never_arrives():
    w = world()
    fault = w.fabric.faults.arm("notif.drop", agent="B", peer="A", times=1)
    w.b.send_notif("A", b"lost")
    assert all_notifs(w.a, 30) == [[]] * 30
    assert fault.fired == 1
    w.b.send_notif("A", b"kept")  # times=1: the next one goes through
    assert all_notifs(w.a, 1) == [[b"kept"]]
    assert [entry[:3] for entry in w.fabric.faults.fired] == [("notif.drop", "B", "A")]


def test_notif_drop_filters_by_peer():
    w = world(extra=("C",))
    w.fabric.faults.arm("notif.drop", peer="A")
    w.b.send_notif("C", b"to-c")
    w.b.send_notif("A", b"to-a")
    assert w.others["C"].get_new_notifs() == {"B": [b"to-c"]}
    assert all_notifs(w.a, 10) == [[]] * 10


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_notif_drop_carried_by_transfer(op):
    w = world()
    fault = w.fabric.faults.arm("notif.drop")
    h = w.read(b"xfer-done") if op == "READ" else w.write(b"xfer-done")
    assert checks_until_done(w.b, h, w.b.transfer(h)) <= 1
    # the transfer itself is fine and its bytes moved ...
    assert w.moved() if op == "READ" else bool((w.t == 0).all())
    # ... only its notification is lost
    assert not any(w.a.check_remote_xfer_done("B", b"xfer-done") for _ in range(30))
    assert fault.fired == 1
    assert [entry[:3] for entry in w.fabric.faults.fired] == [("notif.drop", "B", "A")]


# -- notif.delay ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("delay", [1, 3, 6])
def test_notif_delay_standalone(delay):
    w = world()
    fault = w.fabric.faults.arm("notif.delay", delay=delay)
    w.b.send_notif("A", b"late")
    got = all_notifs(w.a, delay + 5)
    assert got[delay - 1] == [b"late"]
    assert all(x == [] for i, x in enumerate(got) if i != delay - 1)
    assert fault.fired == 1


@pytest.mark.parametrize("delay", [2, 4])
def test_notif_delay_carried_by_transfer(delay):
    w = world().wire()
    fault = w.fabric.faults.arm("notif.delay", agent="B", peer="A", delay=delay)
    h = w.write(b"w-done")
    assert w.b.transfer(h) == "DONE"  # the transfer is not late, only its notification
    assert bool((w.t == 0).all())
    got = all_notifs(w.a, delay + 3)
    assert got[delay - 1] == [b"w-done"]
    assert sum(len(x) for x in got) == 1
    assert fault.fired == 1


# -- peer.disconnect -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("after_posts", [0, 1, 3])
def test_peer_disconnect_after_n_posts(after_posts):
    w = world(extra=("C",)).wire()
    fault = w.fabric.faults.arm("peer.disconnect", agent="B", peer="A", after_posts=after_posts)
    h = w.write()
    for _ in range(after_posts):
        assert w.b.transfer(h) == "DONE"  # a DONE request can be reposted
    assert fault.fired == 0
    for _ in range(3):
        with pytest.raises(_bindings.nixlRemoteDisconnectError):
            w.b.transfer(h)
    with pytest.raises(_bindings.nixlRemoteDisconnectError):
        w.b.transfer(w.read())  # a fresh request towards A fails too: the endpoint is gone
    with pytest.raises(_bindings.nixlRemoteDisconnectError):
        w.b.send_notif("A", b"anyone?")
    # The peer stays known, and A itself is alive and well.
    assert w.b.check_remote_metadata("A")
    assert w.b.check_remote_metadata("A", w.b.get_xfer_descs(w.t))
    assert w.a.agent.conn in w.fabric.conns
    # Other peers are not affected.
    w.b.send_notif("C", b"still-here")
    assert w.others["C"].get_new_notifs() == {"B": [b"still-here"]}
    assert fault.fired >= 1
    assert w.fabric.faults.fired[0][:3] == ("peer.disconnect", "B", "A")


def test_peer_disconnect_counts_posts_per_peer_when_armed_for_any():
    """Armed without a peer (as ``--fault nixl.peer.disconnect:after_posts=1`` is), each endpoint counts its own
    posts: B's first post to C does not use up A's."""
    w = world(extra=("C",)).wire()
    fault = w.fabric.faults.arm("peer.disconnect", agent="B", after_posts=1)
    to_c = w.b.initialize_xfer("WRITE", w.b.get_xfer_descs(w.u), w.b.get_xfer_descs(w.bufs["C"]), "C")
    h = w.write()
    assert w.b.transfer(to_c) == "DONE" and w.b.transfer(h) == "DONE"  # the first post to each
    assert fault.fired == 0 and fault.seen == {("B", "C"): 1, ("B", "A"): 1}
    with pytest.raises(_bindings.nixlRemoteDisconnectError):
        w.b.transfer(h)  # the second to A
    assert [(site, agent, peer) for site, agent, peer, _ in w.fabric.faults.fired] == [("peer.disconnect", "B", "A")]


def test_peer_disconnect_counts_only_posts_to_its_peer():
    w = world(extra=("C",)).wire()
    fault = w.fabric.faults.arm("peer.disconnect", peer="A", after_posts=1)
    to_c = w.b.initialize_xfer("WRITE", w.b.get_xfer_descs(w.u), w.b.get_xfer_descs(w.bufs["C"]), "C")
    for _ in range(4):
        assert w.b.transfer(to_c) == "DONE"
    assert fault.seen == {}
    h = w.write()
    assert w.b.transfer(h) == "DONE"
    with pytest.raises(_bindings.nixlRemoteDisconnectError):
        w.b.transfer(h)
    assert w.b.transfer(to_c) == "DONE"


# -- the board -----------------------------------------------------------------------------------------------
def test_fired_records_site_agent_peer_and_time():
    w = world().wire()
    w.fabric.faults.arm("notif.drop", times=1)
    w.fabric.faults.arm("xfer.late", delay=2, times=1)
    w.b.send_notif("A", b"x")
    t_notif = w.fabric.now()
    w.a.get_new_notifs()
    w.a.get_new_notifs()
    h = w.write()
    first = w.b.transfer(h)
    t_xfer = w.fabric.now()
    assert checks_until_done(w.b, h, first) == 2  # finish it: nothing left in flight towards freed buffers
    assert w.fabric.faults.fired == [("notif.drop", "B", "A", t_notif), ("xfer.late", "B", "A", t_xfer)]
    assert t_xfer > t_notif


def test_armed_fault_fired_counts_every_firing():
    w = world()
    fault = w.fabric.faults.arm("notif.drop")
    for i in range(5):
        w.b.send_notif("A", b"m%d" % i)
    assert fault.fired == 5
    assert len(w.fabric.faults.fired) == 5
    limited = w.fabric.faults.arm("xfer.late", times=2, delay=1)
    for _ in range(4):
        h = w.write()
        checks_until_done(w.b, h, w.b.transfer(h))
    assert limited.fired == 2


def test_disarm_all_stops_firing_and_keeps_the_record():
    w = world()
    stuck = w.fabric.faults.arm("xfer.stuck")
    w.fabric.faults.arm("notif.drop")
    h1 = w.read()
    assert w.b.transfer(h1) == "PROC"
    w.b.send_notif("A", b"dropped")
    record = list(w.fabric.faults.fired)
    assert [r[0] for r in record] == ["xfer.stuck", "notif.drop"]

    w.fabric.faults.disarm_all()
    assert w.fabric.faults.armed == []
    h2 = w.read()
    assert checks_until_done(w.b, h2, w.b.transfer(h2)) <= 1
    assert w.moved()
    w.b.send_notif("A", b"delivered")
    assert all_notifs(w.a, 1) == [[b"delivered"]]
    assert w.fabric.faults.fired == record  # nothing new fired, nothing forgotten
    assert stuck.fired == 1
    assert w.b.check_xfer_state(h1) == "PROC"  # what was stuck before stays stuck


# -- simulated time ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [64, 1 << 20])
def test_simulated_clock_transfer_completes_after_time_model(nbytes):
    now = [10.0]
    f = FakeFabric(clock=lambda: now[0])
    assert f.simulated
    w = World(f, n=nbytes)
    w.t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    duration = f.time_model.xfer_seconds(nbytes)
    assert duration > f.time_model.xfer_latency_s
    h = w.read(b"sim-done")
    start = now[0]
    assert w.b.transfer(h) == "PROC"
    for frac in (0.0, 0.25, 0.5, 0.999):
        now[0] = start + duration * frac
        # calls alone do not make time pass in a simulation
        assert [w.b.check_xfer_state(h) for _ in range(5)] == ["PROC"] * 5
        assert not w.moved()
    now[0] = start + duration * 1.001
    assert w.b.check_xfer_state(h) == "DONE"
    assert w.moved()
    # the carried notification comes notif_latency_s after completion
    assert w.a.get_new_notifs() == {}
    now[0] += f.time_model.notif_latency_s * 1.01
    assert w.a.get_new_notifs() == {"B": [b"sim-done"]}


def test_simulated_transfers_of_one_process_share_its_link_and_other_processes_do_not_wait():
    """Four READs posted together by one process: the fixed costs overlap, the bytes take turns on its link (the
    last done after one latency and four times the bytes, as real NIXL measured on host memory and on an H200:
    docs/validation.md).  A READ another process posts at the same moment waits for none of them."""
    now = [5.0]
    f = FakeFabric(clock=lambda: now[0])
    n = 1 << 20
    src = torch.full((4 * n,), PATTERN, dtype=torch.uint8)
    dst = torch.zeros(4 * n, dtype=torch.uint8)
    alone = torch.zeros(n, dtype=torch.uint8)
    with use_fabric(f):
        a = _api.nixl_agent("A")
        with f.process(f.spawn_process("reader")):
            b = _api.nixl_agent("B")
        with f.process(f.spawn_process("other")):
            c = _api.nixl_agent("C")
    a.register_memory(src)
    b.register_memory(dst)
    c.register_memory(alone)
    for agent in (b, c):
        agent.add_remote_agent(a.get_agent_metadata())
    quarters = [
        b.initialize_xfer(
            "READ", b.get_xfer_descs(dst[i * n : (i + 1) * n]), b.get_xfer_descs(src[i * n : (i + 1) * n]), "A"
        )
        for i in range(4)
    ]
    other = c.initialize_xfer("READ", c.get_xfer_descs(alone), c.get_xfer_descs(src[:n]), "A")
    assert [b.transfer(h) for h in quarters] + [c.transfer(other)] == ["PROC"] * 5
    start, latency, wire = now[0], f.time_model.xfer_latency_s, f.time_model.wire_seconds(n)
    assert f.time_model.xfer_seconds(n) == pytest.approx(latency + wire) and wire > 4 * latency

    def states(t: float) -> list[str]:
        now[0] = start + t
        return [b.check_xfer_state(h) for h in quarters] + [c.check_xfer_state(other)]

    assert states(latency + 0.99 * wire) == ["PROC"] * 5
    assert states(latency + 1.01 * wire) == ["DONE", "PROC", "PROC", "PROC", "DONE"]
    assert states(latency + 3.99 * wire) == ["DONE", "DONE", "DONE", "PROC", "DONE"]
    assert states(latency + 4.01 * wire) == ["DONE"] * 5
    assert bool((dst == src).all()) and bool((alone == PATTERN).all())
    # A READ posted once the link is idle again takes one latency and its own bytes only.
    again = b.initialize_xfer("READ", b.get_xfer_descs(dst[:n]), b.get_xfer_descs(src[:n]), "A")
    assert b.transfer(again) == "PROC"
    posted = now[0]
    now[0] = posted + latency + 1.01 * wire
    assert b.check_xfer_state(again) == "DONE"


def test_simulated_clock_faults_use_seconds():
    now = [0.0]
    f = FakeFabric(clock=lambda: now[0])
    w = World(f)
    f.faults.arm("xfer.late", delay=2.0)
    h = w.read()
    assert w.b.transfer(h) == "PROC"
    now[0] = 1.9
    assert w.b.check_xfer_state(h) == "PROC"
    now[0] = 2.0 + f.time_model.xfer_seconds(N) * 1.01
    assert w.b.check_xfer_state(h) == "DONE"
    assert w.moved()
    assert f.faults.fired == [("xfer.late", "B", "A", 0.0)]


# -- regressions found while writing these tests ----------------------------------------------------------------
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_fail_after_acts_on_cma_transfers_that_would_complete_at_once(op):
    """An armed fail_after must fail a transfer at its Nth check, even one that would otherwise complete quickly,
    instead of being recorded as fired and doing nothing."""
    w = world()
    fault = w.fabric.faults.arm("xfer.fail_after", polls=3, error="REMOTE_DISCONNECT")
    h = w.read() if op == "READ" else w.write()
    assert w.b.transfer(h) == "PROC"
    assert [w.b.check_xfer_state(h) for _ in range(2)] == ["PROC", "PROC"]
    for _ in range(2):
        with pytest.raises(_bindings.nixlRemoteDisconnectError):
            w.b.check_xfer_state(h)
    assert fault.fired == 1
    assert bool((w.u == 0).all()) and bool((w.t == PATTERN).all())  # no bytes moved either way


def test_arm_refuses_parameters_the_site_does_not_read():
    f = FakeFabric()
    with pytest.raises(ValueError, match=r"takes no parameter 'poll'; it takes: error, polls"):
        f.faults.arm("xfer.fail_after", poll=3)
    with pytest.raises(ValueError, match=r"'xfer.stuck' takes no parameter 'delay'; it takes: none"):
        f.faults.arm("xfer.stuck", delay=1)
    assert f.faults.armed == []


def test_peer_disconnect_fires_once_per_endpoint():
    w = world()
    fault = w.fabric.faults.arm("peer.disconnect", peer="A", after_posts=1)
    h = w.read()
    assert w.b.transfer(h) in ("PROC", "DONE")
    checks_until_done(w.b, h, "PROC")
    for _ in range(3):
        with pytest.raises(_bindings.nixlRemoteDisconnectError):
            w.b.transfer(h)
    assert fault.fired == 1
    assert [site for site, *_ in w.fabric.faults.fired] == ["peer.disconnect"]
