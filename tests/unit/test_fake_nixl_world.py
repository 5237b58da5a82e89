"""The fake NIXL's world: import shims, fabrics, simulated processes, freed memory, profiles and determinism.

Every test builds its own :class:`FakeFabric` and creates agents inside ``use_fabric``; the process-wide default
fabric is only looked at (to check that nothing leaked into it), never used.
"""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch

import fakes
import fakes.install
from fakes.install import NIXL_PACKAGES, is_fake
from fakes.nixl import FakeFabric, SimulatedCrash, _api, _bindings, current_fabric, default_fabric, use_fabric
from fakes.nixl._memory import MD_TAG

N = 256
PATTERN = 7


def _nixl_modules() -> dict[str, object]:
    """Every sys.modules entry under one of the five NIXL package names, by identity."""
    return {k: v for k, v in sys.modules.items() if k.split(".")[0] in NIXL_PACKAGES}


def _sections(md: bytes) -> list[list[int]]:
    assert md.startswith(MD_TAG)
    return json.loads(md[len(MD_TAG) :])["sections"]


class Pair:
    """Target ``A`` (buffer ``t`` full of PATTERN) and initiator ``B`` (buffer ``u`` zeroed) in ``fabric``."""

    def __init__(self, fabric: FakeFabric, a_pid: int | None = None) -> None:
        self.fabric = fabric
        with use_fabric(fabric):
            if a_pid is None:
                self.a = _api.nixl_agent("A")
            else:
                with fabric.process(a_pid):
                    self.a = _api.nixl_agent("A")
            self.b = _api.nixl_agent("B")
        self.t = torch.full((N,), PATTERN, dtype=torch.uint8)
        self.u = torch.zeros(N, dtype=torch.uint8)
        self.a.register_memory(self.t)
        self.b.register_memory(self.u)
        self.b.add_remote_agent(self.a.get_agent_metadata())
        self.a.add_remote_agent(self.b.get_agent_metadata())

    def read(self, notif: bytes = b""):
        return self.b.initialize_xfer("READ", self.b.get_xfer_descs(self.u), self.b.get_xfer_descs(self.t), "A", notif)

    def read_to_done(self) -> str:
        h = self.read()
        state = self.b.transfer(h)
        for _ in range(10):
            if state == "DONE":
                break
            state = self.b.check_xfer_state(h)
        return state


# -- import shims ------------------------------------------------------------------------------------------
def _check_shims_active(fabric: FakeFabric | None = None) -> None:
    for name in NIXL_PACKAGES:
        pkg = importlib.import_module(name)
        api = importlib.import_module(f"{name}._api")
        bindings = importlib.import_module(f"{name}._bindings")
        assert is_fake(pkg), name
        assert api is _api and bindings is _bindings, name
        assert is_fake(api) and is_fake(bindings)
        assert pkg.nixl_agent is _api.nixl_agent and pkg._api is _api
    from nixl._api import nixl_agent  # the spelling vLLM uses
    from nixl._bindings import nixlRemoteDisconnectError

    assert nixl_agent is _api.nixl_agent
    assert nixlRemoteDisconnectError is _bindings.nixlRemoteDisconnectError
    if fabric is not None:
        agent = nixl_agent("shimmed")
        assert agent.agent.fabric is fabric


def test_installed_shims_every_package_name_and_restores_absent_modules(monkeypatch):
    for name in list(_nixl_modules()):  # pretend no NIXL was ever imported; monkeypatch puts them back
        monkeypatch.delitem(sys.modules, name)
    before = _nixl_modules()
    assert before == {}
    with fakes.installed() as got:
        assert got is None
        _check_shims_active()
    assert _nixl_modules() == before
    for name in NIXL_PACKAGES:
        assert name not in sys.modules and f"{name}._api" not in sys.modules


def test_installed_with_fabric_puts_new_agents_in_it():
    f = FakeFabric()
    before = _nixl_modules()
    with fakes.installed(f) as got:
        assert got is f
        assert current_fabric() is f
        _check_shims_active(f)
    assert current_fabric() is not f
    after = _nixl_modules()
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)


def test_installed_restores_the_real_nixl_exactly():
    real_api = pytest.importorskip("nixl._api", reason="real NIXL wheel not installed")
    assert not is_fake(real_api) and not is_fake(sys.modules["nixl"])
    before = _nixl_modules()
    assert before["nixl._api"] is real_api
    with fakes.installed():
        assert sys.modules["nixl._api"] is _api
        _check_shims_active()
        import nixl._api as inside

        assert inside is _api
    after = _nixl_modules()
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)
    import nixl._api as again

    assert again is real_api and not is_fake(sys.modules["nixl"])


def test_installed_restores_on_exception_and_when_nested():
    before = _nixl_modules()
    with pytest.raises(RuntimeError, match="boom"):
        with fakes.installed():
            with fakes.installed():
                assert is_fake(sys.modules["rixl"])
            assert is_fake(sys.modules["nixl_rocm._api"])  # the outer block is still in force
            raise RuntimeError("boom")
    after = _nixl_modules()
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)


def test_is_fake_rejects_other_modules():
    assert not is_fake(json)
    assert not is_fake(fakes.install)
    assert is_fake(_api) and is_fake(_bindings)


# -- fabrics -----------------------------------------------------------------------------------------------
def test_agents_created_in_use_fabric_live_in_that_fabric_only():
    f, g = FakeFabric(), FakeFabric()
    default = default_fabric()
    default_conns = set(default.conns.keys())
    with use_fabric(f):
        assert current_fabric() is f
        a = _api.nixl_agent("A")
        with use_fabric(g):
            assert current_fabric() is g
            b = _api.nixl_agent("B")
        assert current_fabric() is f
        c = _api.nixl_agent("C")
    assert current_fabric() is default
    assert a.agent.fabric is f and c.agent.fabric is f and b.agent.fabric is g
    assert set(f.conns.keys()) == {a.agent.conn, c.agent.conn}
    assert set(g.conns.keys()) == {b.agent.conn}
    assert set(default.conns.keys()) == default_conns


def test_agents_of_different_fabrics_cannot_reach_each_other():
    f, g = FakeFabric(), FakeFabric()
    with use_fabric(f):
        a = _api.nixl_agent("A")
    with use_fabric(g):
        b = _api.nixl_agent("B")
    t = torch.full((N,), PATTERN, dtype=torch.uint8)
    a.register_memory(t)
    with pytest.raises(_bindings.nixlBackendError):  # metadata is just bytes, but A is not in B's world:
        b.add_remote_agent(a.get_agent_metadata())  # loading it connects, and nothing answers
    assert not b.check_remote_metadata("A")


def test_agent_destroyed_by_refcount_leaves_the_fabric():
    f = FakeFabric()
    events = []
    f.listeners.append(lambda kind, fields: events.append((kind, fields.get("agent"))))
    with use_fabric(f):
        a = _api.nixl_agent("A")
    conn = a.agent.conn
    assert conn in f.conns
    del a
    assert conn not in f.conns
    assert ("agent.create", "A") in events and ("agent.destroy", "A") in events


# -- simulated processes ----------------------------------------------------------------------------------
def test_spawn_process_and_process_context():
    f = FakeFabric()
    assert f.current_process() == 0 and f.alive(0)
    p1 = f.spawn_process("worker")
    p2 = f.spawn_process()
    assert (p1, p2) == (1, 2)
    assert f.processes[p1].name == "worker" and f.processes[p2].name == "proc2"
    with use_fabric(f):
        with f.process(p1) as pid:
            assert pid == p1 and f.current_process() == p1
            a = _api.nixl_agent("A")
            with f.process(p2):
                b = _api.nixl_agent("B")
            assert f.current_process() == p1
        c = _api.nixl_agent("C")
    assert (a.agent.pid, b.agent.pid, c.agent.pid) == (p1, p2, 0)
    assert f.current_process() == 0
    assert a.agent.conn != b.agent.conn
    with pytest.raises(LookupError, match="spawn"):
        with f.process(99):
            pass


def test_kill_process_makes_its_agents_vanish_for_their_peers():
    f = FakeFabric()
    pid = f.spawn_process("victim")
    events = []
    f.listeners.append(lambda kind, fields: events.append(kind))
    w = Pair(f, a_pid=pid)
    with use_fabric(f), f.process(pid):
        sibling = _api.nixl_agent("A2")  # a second agent of the same process
    w.b.add_remote_agent(sibling.get_agent_metadata())
    assert w.read_to_done() == "DONE"
    w.u.zero_()
    pending = w.read()

    f.kill_process(pid)

    assert not f.alive(pid) and f.alive(0)
    assert w.a.agent.destroyed and sibling.agent.destroyed
    assert w.a.agent.conn not in f.conns and sibling.agent.conn not in f.conns
    assert w.b.agent.conn in f.conns
    assert events.count("agent.destroy") == 2 and "process.kill" in events
    with pytest.raises(_bindings.nixlRemoteDisconnectError):
        w.b.transfer(pending)  # made before the kill, posted after
    with pytest.raises(_bindings.nixlRemoteDisconnectError):
        w.b.transfer(w.read())
    with pytest.raises(_bindings.nixlRemoteDisconnectError):
        w.b.send_notif("A", b"are you there")
    with pytest.raises(_bindings.nixlRemoteDisconnectError):
        w.b.send_notif("A2", b"are you there")
    assert bool((w.u == 0).all())
    assert w.b.check_remote_metadata("A")  # still "known", as with real NIXL


def test_kill_process_during_a_transfer_fails_it():
    f = FakeFabric(transport="tcp")  # a READ takes 3 ticks: still in flight at the kill
    pid = f.spawn_process()
    w = Pair(f, a_pid=pid)
    h = w.read()
    assert w.b.transfer(h) == "PROC"
    f.kill_process(pid)
    with pytest.raises(_bindings.nixlRemoteDisconnectError):
        for _ in range(5):
            w.b.check_xfer_state(h)
    assert bool((w.u == 0).all())


def test_kill_process_spares_other_processes():
    f = FakeFabric()
    doomed, spared = f.spawn_process(), f.spawn_process()
    w = Pair(f, a_pid=spared)
    with use_fabric(f), f.process(doomed):
        other = _api.nixl_agent("X")
    f.kill_process(doomed)
    assert other.agent.destroyed and not w.a.agent.destroyed
    assert w.read_to_done() == "DONE"
    assert bool((w.u == PATTERN).all())


# -- listeners ------------------------------------------------------------------------------------------------
def test_listener_channels_see_the_same_transfer():
    """``listeners`` get every event as fields; ``event_listeners`` every event but a transfer's post and completion;
    ``xfer_listeners`` those two as (kind, agent core, request, target connection), with the same facts."""
    f = FakeFabric()
    every, lifecycle, raw = [], [], []
    f.listeners.append(lambda kind, fields: every.append((kind, dict(fields))))
    f.event_listeners.append(lambda kind, fields: lifecycle.append(kind))
    f.xfer_listeners.append(
        lambda kind, core, req, target: raw.append(
            (kind, core.name, core.pid, core.conn, req.peer, target, req.op, req.nbytes, req.spans)
        )
    )
    w = Pair(f)
    assert w.read_to_done() == "DONE"
    assert [k for k, _ in every if not k.startswith("xfer.")] == lifecycle
    assert "xfer.post" not in lifecycle and "register" in lifecycle
    xfers = [(k, f) for k, f in every if k.startswith("xfer.")]
    assert [k for k, _ in xfers] == [r[0] for r in raw] == ["xfer.post", "xfer.done"]
    for (_, fields), (_, agent, pid, conn, peer, target, op, nbytes, (local, remote)) in zip(xfers, raw):
        assert (
            fields["agent"],
            fields["pid"],
            fields["conn"],
            fields["peer"],
            fields["target"],
            fields["op"],
            fields["nbytes"],
        ) == (agent, pid, conn, peer, target, op, nbytes)
        assert fields["local"] == list(local) == [(w.u.data_ptr(), N)]
        assert fields["remote"] == list(remote) == [(w.t.data_ptr(), N)]
        assert target == w.a.agent.conn and conn == w.b.agent.conn


# -- freed memory -----------------------------------------------------------------------------------------
def test_free_makes_a_peers_later_read_fail():
    f = FakeFabric()
    events = []
    f.listeners.append(lambda kind, fields: events.append((kind, fields)))
    w = Pair(f)
    assert w.read_to_done() == "DONE"
    w.u.zero_()
    addr = w.t.data_ptr()
    assert not f.is_freed(addr, N)
    f.free(addr + N // 2, N // 2)  # only the second half of A's buffer went back to the OS
    assert f.is_freed(addr, N) and not f.is_freed(addr, N // 2)
    assert ("memory.free", {"addr": addr + N // 2, "length": N // 2}) in events
    with pytest.raises(_bindings.nixlRemoteDisconnectError):
        w.b.transfer(w.read())
    assert bool((w.u == 0).all())  # nothing was copied
    # UCX failed the endpoint: later operations towards A fail as well, although A is alive.
    with pytest.raises(_bindings.nixlRemoteDisconnectError):
        w.b.send_notif("A", b"x")
    assert w.a.agent.conn in f.conns


def test_reuse_clears_a_freed_range():
    f = FakeFabric()
    f.free(0x1000, 0x100)
    assert f.is_freed(0x1080, 1) and f.is_freed(0xF00, 0x101) and not f.is_freed(0xF00, 0x100)
    f.reuse(0x1000, 0x100)
    assert not f.is_freed(0x1000, 0x100)


# -- profiles ---------------------------------------------------------------------------------------------
def test_rocm_strict_refuses_overlap_within_one_process():
    f = FakeFabric("rocm-strict")
    with use_fabric(f):
        a1, a2 = _api.nixl_agent("A1"), _api.nixl_agent("A2")
    t = torch.ones(N, dtype=torch.uint8)
    a1.register_memory(t)
    md = a2.get_agent_metadata()
    with pytest.raises(_bindings.nixlBackendError):
        a2.register_memory(t)  # the same range
    with pytest.raises(_bindings.nixlBackendError):
        a2.register_memory([(t.data_ptr() + N // 2, N, 0, "")], "DRAM")  # a partial overlap
    with pytest.raises(_bindings.nixlBackendError):
        a1.register_memory(t)  # and again in the same agent
    assert a2.agent.regions == [] and a2.get_agent_metadata() == md
    # adjacent, not overlapping: fine
    a2.register_memory([(t.data_ptr() + N, N, 0, "")], "DRAM")
    assert len(a2.agent.regions) == 1


def test_rocm_strict_allows_the_same_range_in_two_processes():
    f = FakeFabric("rocm-strict")
    pid = f.spawn_process()
    with use_fabric(f):
        a1 = _api.nixl_agent("A1")
        with f.process(pid):
            a2 = _api.nixl_agent("A2")
    t = torch.ones(N, dtype=torch.uint8)
    a1.register_memory(t)
    a2.register_memory(t)
    assert len(a1.agent.regions) == len(a2.agent.regions) == 1


def test_dram_allows_overlap_within_one_process():
    f = FakeFabric("dram")
    with use_fabric(f):
        a1, a2 = _api.nixl_agent("A1"), _api.nixl_agent("A2")
    t = torch.ones(N, dtype=torch.uint8)
    a1.register_memory(t)
    a2.register_memory(t)
    a1.register_memory(t)
    assert len(a1.agent.regions) == 2 and len(a2.agent.regions) == 1


@pytest.mark.parametrize("profile, identical", [("dram", True), ("cuda", True), ("rdma", False)])
def test_reregistration_metadata(profile, identical):
    f = FakeFabric(profile)
    with use_fabric(f):
        a = _api.nixl_agent("A")
    t = torch.ones(N, dtype=torch.uint8)
    descs = a.register_memory(t)
    md1 = a.get_agent_metadata()
    a.deregister_memory(descs)
    assert _sections(a.get_agent_metadata()) == []
    a.register_memory(t)
    md2 = a.get_agent_metadata()
    assert (md1 == md2) is identical
    s1, s2 = _sections(md1), _sections(md2)
    assert [s[:4] for s in s1] == [s[:4] for s in s2] == [[0, t.data_ptr(), N, 0]]  # same range either way
    assert (s1[0][4] == s2[0][4]) is identical  # only the remote key differs


def test_dram_reregistration_of_one_of_several_ranges_is_byte_identical():
    # Checked against the real nixl-cu12 1.5.1 on CPU: md1 == md2 there.
    f = FakeFabric("dram")
    with use_fabric(f):
        a = _api.nixl_agent("A")
    t1, t2 = torch.ones(N, dtype=torch.uint8), torch.ones(N, dtype=torch.uint8)
    d1 = a.register_memory(t1)
    a.register_memory(t2)
    md1 = a.get_agent_metadata()
    a.deregister_memory(d1)
    a.register_memory(t1)
    assert a.get_agent_metadata() == md1


def test_dram_posting_a_released_handle_is_a_simulated_segfault():
    w = Pair(FakeFabric("dram"))
    h = w.read()
    h.release()
    assert issubclass(SimulatedCrash, BaseException) and not issubclass(SimulatedCrash, Exception)
    with pytest.raises(SimulatedCrash) as info:
        try:
            w.b.transfer(h)
        except Exception:  # noqa: BLE001 - code under test catching Exception must not swallow a crash
            pytest.fail("SimulatedCrash was caught as an Exception")
    assert info.value.signal == "SIGSEGV"
    assert str(info.value).startswith("SIGSEGV")
    assert bool((w.u == 0).all())


@pytest.mark.parametrize("profile", ["cuda", "rdma", "rocm-strict"])
def test_strict_profiles_raise_invalid_param_for_a_released_handle(profile):
    w = Pair(FakeFabric(profile))
    h = w.read()
    h.release()
    with pytest.raises(_bindings.nixlInvalidParamError):
        w.b.transfer(h)
    with pytest.raises(_bindings.nixlInvalidParamError):
        w.b.check_xfer_state(h)
    assert bool((w.u == 0).all())


# -- determinism ------------------------------------------------------------------------------------------
def _scenario(profile: str, bufs: list[torch.Tensor]) -> tuple:
    """A fixed sequence of calls with a few faults armed; returns everything observable about it."""
    f = FakeFabric(profile, transport="tcp")
    pid = f.spawn_process("peer")
    events = []
    f.listeners.append(lambda kind, fields: events.append((kind, sorted(fields.items()))))
    f.faults.arm("notif.delay", delay=2)
    f.faults.arm("xfer.late", delay=3, times=1)
    f.faults.arm("peer.disconnect", peer="C", after_posts=1)
    with use_fabric(f):
        with f.process(pid):
            a = _api.nixl_agent("A")
        b, c = _api.nixl_agent("B"), _api.nixl_agent("C")
    t, u, v = bufs
    a.register_memory(t)
    b.register_memory(u)
    c.register_memory(v)
    mds = [a.get_agent_metadata(), b.get_agent_metadata(), c.get_agent_metadata()]
    for x, y in ((a, b), (b, a), (c, b), (b, c)):
        y.add_remote_agent(x.get_agent_metadata())
    states = []
    h = b.initialize_xfer("READ", b.get_xfer_descs(u), b.get_xfer_descs(t), "A", b"r")
    states.append(b.transfer(h))
    states += [b.check_xfer_state(h) for _ in range(8)]
    g = b.initialize_xfer("WRITE", b.get_xfer_descs(u), b.get_xfer_descs(v), "C")
    states.append(b.transfer(g))
    states += [b.check_xfer_state(g) for _ in range(4)]
    try:
        b.transfer(g)
    except _bindings.nixlRemoteDisconnectError as exc:
        states.append(type(exc).__name__)
    b.send_notif("A", b"n")
    notifs = [a.get_new_notifs() for _ in range(4)]
    a.deregister_memory(a.get_reg_descs([(t.data_ptr(), t.numel(), 0, "")], "DRAM"))
    a.register_memory(t)
    mds.append(a.get_agent_metadata())
    return mds, list(f.faults.fired), states, notifs, events, f.now()


@pytest.mark.parametrize("profile", ["dram", "rdma"])
def test_same_calls_in_fresh_fabrics_are_identical(profile):
    bufs = [torch.full((N,), i, dtype=torch.uint8) for i in (PATTERN, 0, 0)]
    first = _scenario(profile, bufs)
    second = _scenario(profile, bufs)
    mds, fired, states, notifs, _, _ = first
    assert first[0] == second[0]  # metadata bytes
    assert first[1] == second[1]  # fault log, times included
    assert first == second
    # ... and the scenario really exercised what it claims to
    assert [site for site, *_ in fired] == ["xfer.late", "notif.delay", "peer.disconnect", "notif.delay"]
    assert states[0] == "PROC" and states[8] == "DONE" and states[-1] == "nixlRemoteDisconnectError"
    assert notifs == [{"B": [b"r"]}, {"B": [b"n"]}, {}, {}]
    assert bool((bufs[1] == PATTERN).all())
    assert (mds[0] == mds[-1]) is (profile == "dram")


# -- shared peer tables and released handles (EP-scale memory) ------------------------------------------------
def test_loaders_of_the_same_metadata_share_one_table_and_a_merge_copies_it():
    fabric = FakeFabric("dram")
    with use_fabric(fabric):
        a, b, c = (_api.nixl_agent(n) for n in "ABC")
    t, t2 = torch.zeros(N, dtype=torch.uint8), torch.zeros(N, dtype=torch.uint8)
    a.register_memory(t)
    md = a.get_agent_metadata()
    b.add_remote_agent(md)
    c.add_remote_agent(md)
    table = b.agent.peers["A"].table
    assert c.agent.peers["A"].table is table and len(table) == 1
    a.register_memory(t2)
    b.add_remote_agent(a.get_agent_metadata())  # same connection: sections merged into a new table for B only
    assert len(b.agent.peers["A"].table) == 2 and c.agent.peers["A"].table is table and len(table) == 1
    assert b.check_remote_metadata("A", b.get_xfer_descs(t2)) and not c.check_remote_metadata("A", c.get_xfer_descs(t2))


def test_released_handles_are_remembered_without_their_requests():
    fabric = FakeFabric("cuda")  # a strict profile: use after release raises instead of crashing
    pair = Pair(fabric)
    h = pair.read()
    assert pair.b.transfer(h) in ("DONE", "PROC")
    raw = h._handle
    pair.b.release_xfer_handle(h)
    core = pair.b.agent
    assert raw not in core.xfers and raw in core.released_handles
    with pytest.raises(_bindings.nixlInvalidParamError):
        core.postXferReq(raw)


def test_restart_in_place_keeps_the_name_and_the_wrapper_and_changes_the_connection():
    from fakes.nixl._agent import restart_in_place

    pair = Pair(FakeFabric("dram"))
    old = pair.a.agent
    with use_fabric(pair.fabric):
        new = restart_in_place(old)
    assert pair.a.agent is new and new.name == old.name == "A" and new.conn != old.conn and old.destroyed
    assert [(r.addr, r.length) for r in new.regions] == [(pair.t.data_ptr(), N)]
    with pytest.raises(_bindings.nixlNotAllowedError):  # B kept the old entry: a new connection under that name
        pair.b.add_remote_agent(pair.a.get_agent_metadata())
    pair.b.remove_remote_agent("A")
    pair.b.add_remote_agent(pair.a.get_agent_metadata())
    assert pair.read_to_done() == "DONE" and torch.equal(pair.u, pair.t)


def test_a_descriptor_list_of_a_shape_pybind_takes_no_constructor_for_is_refused_by_name():
    """A tuple of tuples (or any other shape than a list, an Nx3 array or a size) is a TypeError naming what was
    given, as pybind11's is; the constructor's own ``type`` keyword (NIXL's name) must not shadow the builtin."""
    dram = _bindings.nixl_mem_t.DRAM_SEG
    for cls in (_bindings.nixlXferDList, _bindings.nixlRegDList):
        with pytest.raises(TypeError, match=r"incompatible constructor arguments; got tuple"):
            cls(dram, ((1, 2, 3),))
