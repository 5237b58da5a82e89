"""The communicator strategies under test, driven through real expert moves in the simulation kernel.

Three simulated processes (pid = rank), one greenlet thread each, fake NIXL in a fresh fabric on the simulated
clock, fake torch.distributed groups.  Expert weights are small CPU float32 tensors ``[layer][tensor]`` shaped
``[num_local_experts, 4]`` whose rows carry a signature of (layer, tensor, logical expert), so a wrong move shows.
"""

from __future__ import annotations

import collections
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

import fakes
from fakes import torch_dist
from fakes.nixl import FakeFabric
from fakes.nixl._bindings import nixlBackendError
from fakes.torch_dist import Rendezvous
from sim.eplb.communicators import plugins
from sim.errors import UnknownStrategy
from sim.kernel import Kernel

BUILTINS = ["per-communicator-agent", "arena-registry", "shared-agent"]
BROKEN = "tests.strategies.broken_shared_agent:create"
WORLD, LAYERS, TENSORS, LOCAL, HIDDEN = 3, 2, 2, 2, 4
REGIONS = LAYERS * TENSORS + TENSORS  # what one registration covers: every layer's tensors plus expert_buffer

# Placements, per layer: physical slot (rank * LOCAL + row) -> logical expert; -1 is an empty slot.
P0 = [[0, 1, 2, 3, 4, 0], [0, 1, 2, 2, 3, 4]]  # layer 1: rank 1 holds expert 2 twice (first occurrence wins)
P1 = [[4, 0, 0, 2, 1, 3], [3, 4, 1, 0, 2, -1]]  # layer 1: rank 2 row 1 becomes empty
P2 = [[2, 3, 4, 1, 2, 3], [0, -1, 3, 2, 1, 4]]  # every rank reads from rank 1 in layer 0


def sig(layer: int, tensor: int, expert: int) -> float:
    return float(1000 * layer + 100 * tensor + expert)


def make_weights(rank: int, placement: list[list[int]]) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    weights = []
    for layer in range(LAYERS):
        tensors = []
        for t in range(TENSORS):
            w = torch.empty(LOCAL, HIDDEN, dtype=torch.float32)
            for row in range(LOCAL):
                expert = placement[layer][rank * LOCAL + row]
                w[row].fill_(sig(layer, t, expert) if expert != -1 else -1.0)
            tensors.append(w)
        weights.append(tensors)
    buffer = [torch.full((LOCAL, HIDDEN), -7.0) for _ in range(TENSORS)]
    return weights, buffer


def source(old: list[int], expert: int, dst: int) -> int:
    """The rank ``dst`` receives ``expert`` from: itself if it has it, else the first rank holding it."""
    if expert in old[dst * LOCAL : (dst + 1) * LOCAL]:
        return dst
    return next(r for r in range(WORLD) if expert in old[r * LOCAL : (r + 1) * LOCAL])


def move(comm, rank: int, weights, buffer, old: list[list[int]], new: list[list[int]]) -> None:
    """vLLM's layer-by-layer rearrangement: move_to_buffer (through the communicator), then move_from_buffer."""
    for layer in range(LAYERS):
        o, n = old[layer], new[layer]
        comm.set_transfer_context(torch.tensor(o), layer)
        for dst in range(WORLD):
            for row in range(LOCAL):
                expert = n[dst * LOCAL + row]
                if expert == -1:
                    continue
                src = source(o, expert, dst)
                if src == rank and dst != rank:
                    src_row = o[rank * LOCAL : (rank + 1) * LOCAL].index(expert)
                    comm.add_send([weights[layer][t][src_row] for t in range(TENSORS)], dst, expert)
                if dst == rank:
                    comm.add_recv([buffer[t][row] for t in range(TENSORS)], src, expert)
        comm.execute()
        for row in range(LOCAL):
            if n[rank * LOCAL + row] != -1:
                for t in range(TENSORS):
                    weights[layer][t][row].copy_(buffer[t][row])


def wrong_rows(rank: int, weights, placement: list[list[int]]) -> list[tuple[int, int, int]]:
    """(layer, tensor, row) of every non-empty slot whose contents are not its expert's signature."""
    bad = []
    for layer in range(LAYERS):
        for t in range(TENSORS):
            for row in range(LOCAL):
                expert = placement[layer][rank * LOCAL + row]
                want = torch.full((HIDDEN,), sig(layer, t, expert))
                if expert != -1 and not torch.equal(weights[layer][t][row], want):
                    bad.append((layer, t, row))
    return bad


def snapshot(fabric: FakeFabric) -> dict[int, tuple[int, int, int]]:
    """Per process: (live agents, registrations over all its agents, distinct registered ranges)."""
    agents: dict[int, int] = collections.Counter()
    ranges: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for conn in sorted(fabric.conns.keys()):
        core = fabric.conns.get(conn)
        if core is None:
            continue
        agents[core.pid] += 1
        for region in core.regions:
            ranges[core.pid][(region.addr, region.length)] += 1
    return {pid: (agents[pid], sum(ranges[pid].values()), len(ranges[pid])) for pid in sorted(agents)}


@dataclass
class World:
    kernel: Kernel
    fabric: FakeFabric
    factories: list[Callable]
    groups: list[list[Any]]  # generation -> rank -> group
    sync: list[Any]  # a test-only group for checkpoints
    results: dict = field(default_factory=dict)
    events: list = field(default_factory=list)
    phase: str = "start"

    def barrier(self, rank: int) -> None:
        torch_dist.barrier(group=self.sync[rank])

    def at_checkpoint(self, rank: int, fn: Callable[[], None]) -> None:
        """Run ``fn`` on rank 0 while every rank waits between two barriers (nobody moves meanwhile)."""
        self.barrier(rank)
        if rank == 0:
            fn()
        self.barrier(rank)


def run_world(strategy: str, body: Callable[[World, int], None], profile: str = "dram") -> World:
    kernel = Kernel(seed=0)

    def whoami() -> int:
        thread = kernel.current()
        assert thread is not None  # the fabric asks from inside a simulated thread
        return thread.pid

    fabric = FakeFabric(profile, clock=kernel.now, whoami=whoami)
    fabric.poll_wait = lambda due: kernel.sleep(
        min(max(due - kernel.now(), 1e-6), 1e-3) if due != float("inf") else 1e-3
    )
    pids = list(range(WORLD))
    with fakes.installed(fabric), torch_dist.installed():
        world = World(
            kernel,
            fabric,
            factories=[plugins.load(strategy) for _ in pids],  # one fresh module instance per process
            groups=[Rendezvous(kernel, f"eplb#{g}", pids, timeout_s=300).groups() for g in range(2)],
            sync=Rendezvous(kernel, "test#sync", pids, timeout_s=3600).groups(),  # outwaits eplb timeouts
        )
        fabric.listeners.append(lambda kind, fields: world.events.append((world.phase, kind, dict(fields))))
        for rank in pids:
            kernel.spawn(f"rank{rank}", body, world, rank, pid=rank)
        kernel.run()
        crashes = [(th.name, exc) for th, exc in kernel.crashes]
        kernel.close()
    assert not crashes, crashes
    assert not kernel.unraisable, kernel.unraisable  # no finalizer raised (every __del__ suppresses its errors)
    return world


# -- (a) a permutation of experts, layer by layer --------------------------------------------------------------
@pytest.mark.parametrize("strategy", BUILTINS)
def test_a_permutation_moves_every_expert_to_its_new_slot(strategy: str) -> None:
    def body(w: World, rank: int) -> None:
        weights, buffer = make_weights(rank, P0)
        comm = w.factories[rank](w.groups[0][rank], weights, buffer)
        move(comm, rank, weights, buffer, P0, P1)
        w.results[rank] = (wrong_rows(rank, weights, P1), w.kernel.now() > 0)

    w = run_world(strategy, body)
    assert w.results == {0: ([], True), 1: ([], True), 2: ([], True)}
    assert len(w.fabric.conns) == 0  # every agent died with its communicator: nothing kept it (or a cycle) alive


# -- (b) elastic replacement: a new communicator on a new group, built from the old one --------------------------
def replacement(w: World, rank: int) -> None:
    weights, buffer = make_weights(rank, P0)
    old = w.factories[rank](w.groups[0][rank], weights, buffer)
    move(old, rank, weights, buffer, P0, P1)
    new = w.factories[rank](w.groups[1][rank], weights, buffer, prev_communicator=old)
    w.at_checkpoint(rank, lambda: w.results.update(both=snapshot(w.fabric), both_agents=len(w.fabric.conns)))
    del old
    w.at_checkpoint(rank, lambda: w.results.update(after=snapshot(w.fabric), after_agents=len(w.fabric.conns)))
    move(new, rank, weights, buffer, P1, P2)
    w.results[rank] = wrong_rows(rank, weights, P2)


@pytest.mark.parametrize(
    "strategy, both",
    [
        ("per-communicator-agent", (2, 2 * REGIONS, REGIONS)),  # a second agent, every page registered twice
        ("arena-registry", (1, REGIONS, REGIONS)),
        ("shared-agent", (1, REGIONS, REGIONS)),
    ],
)
def test_b_elastic_replacement_moves_again_and_counts_agents(strategy: str, both: tuple[int, int, int]) -> None:
    w = run_world(strategy, replacement)
    assert {r: w.results[r] for r in range(WORLD)} == {0: [], 1: [], 2: []}
    assert w.results["both"] == {0: both, 1: both, 2: both}
    assert w.results["both_agents"] == WORLD * both[0]
    assert w.results["after"] == {0: (1, REGIONS, REGIONS), 1: (1, REGIONS, REGIONS), 2: (1, REGIONS, REGIONS)}
    assert w.results["after_agents"] == WORLD
    assert len(w.fabric.conns) == 0


def test_b_literal_counts_per_communicator_agent_vs_shared_agent() -> None:
    per = run_world("per-communicator-agent", replacement).results["both"]
    shared = run_world("shared-agent", replacement).results["both"]
    assert per == {0: (2, 12, 6), 1: (2, 12, 6), 2: (2, 12, 6)}  # 2 agents per process, same 6 ranges twice
    assert shared == {0: (1, 6, 6), 1: (1, 6, 6), 2: (1, 6, 6)}  # 1 agent, no duplicate


# -- (c) rocm-strict: a second registration of the same pages in one process fails ------------------------------
@pytest.mark.parametrize(
    "strategy, outcome",
    [
        ("per-communicator-agent", "nixlBackendError"),
        ("arena-registry", "ok"),
        ("shared-agent", "ok"),
    ],
)
def test_c_rocm_strict_refuses_the_second_registration(strategy: str, outcome: str) -> None:
    def body(w: World, rank: int) -> None:
        weights, buffer = make_weights(rank, P0)
        old = w.factories[rank](w.groups[0][rank], weights, buffer)
        move(old, rank, weights, buffer, P0, P1)
        try:
            new = w.factories[rank](w.groups[1][rank], weights, buffer, prev_communicator=old)
        except nixlBackendError as exc:
            w.results[rank] = type(exc).__name__
            return
        del old
        move(new, rank, weights, buffer, P1, P2)
        w.results[rank] = "ok" if not wrong_rows(rank, weights, P2) else "wrong"

    w = run_world(strategy, body, profile="rocm-strict")
    assert w.results == {0: outcome, 1: outcome, 2: outcome}


# -- (d) the broken user strategy: the old communicator's __del__ deregisters the shared agent's memory -----------
def one_rank_drops_old(w: World, rank: int) -> None:
    """Move with the old communicator, build the new one from it, then only rank 1 drops the old one (its GC ran
    first) and everybody moves again with the new one.  Outcomes per rank: "ok", "wrong" or the exception."""
    weights, buffer = make_weights(rank, P0)
    old = [w.factories[rank](w.groups[0][rank], weights, buffer)]
    move(old[0], rank, weights, buffer, P0, P1)
    new = w.factories[rank](w.groups[1][rank], weights, buffer, prev_communicator=old[0])
    w.results.setdefault("names", {})[rank] = new.nixl_wrapper.name
    w.at_checkpoint(rank, lambda: setattr(w, "phase", "drop"))
    if rank == 1:
        old.clear()

    def note_live_then_move() -> None:
        w.results.update(live=sorted(c.name for c in w.fabric.conns.values()))
        w.phase = "move"

    w.at_checkpoint(rank, note_live_then_move)
    try:
        move(new, rank, weights, buffer, P1, P2)
        w.results[rank] = "ok" if not wrong_rows(rank, weights, P2) else "wrong"
    except Exception as exc:  # noqa: BLE001 - the outcome is the finding
        w.results[rank] = type(exc).__name__
    w.results[f"buffer{rank}"] = buffer[0][:, 0].tolist()  # tensor 0, column 0 of each buffer row
    # A rank whose move failed stays up (its agent alive) until every rank has an outcome: otherwise the end of
    # its thread destroys its agent, and its peers' READs fail with RemoteDisconnect for that reason instead.
    w.barrier(rank)


@pytest.mark.parametrize(
    "profile, outcomes",
    [
        # RDMA checks keys: peers' READs from rank 1 fail, and rank 1's own READs find no local registration.
        ("rdma", {0: "nixlRemoteDisconnectError", 1: "nixlNotFoundError", 2: "nixlRemoteDisconnectError"}),
        # cma copies from deregistered memory (correct bytes, silently); only rank 1 fails, the others wait for it.
        ("dram", {0: "CollectiveTimeout", 1: "nixlNotFoundError", 2: "CollectiveTimeout"}),
    ],
)
def test_d_broken_strategy_reads_from_deregistered_memory(profile: str, outcomes: dict) -> None:
    w = run_world(BROKEN, one_rank_drops_old, profile=profile)
    name1 = w.results["names"][1]
    # Dropping rank 1's old communicator deregistered all 6 ranges of the agent rank 1's new communicator uses...
    assert [(kind, f["pid"], f["agent"], len(f["ranges"])) for phase, kind, f in w.events if phase == "drop"] == [
        ("deregister", 1, name1, REGIONS)
    ]
    assert name1 in w.results["live"]  # ...while that agent is alive and about to serve the next move
    assert {r: w.results[r] for r in range(WORLD)} == outcomes
    # The READs that the peers then made from rank 1's deregistered rows: completed on cma, refused over RDMA.
    reads = sorted(
        (f["pid"], kind)
        for phase, kind, f in w.events
        if phase == "move" and kind in ("xfer.post", "xfer.done") and f["peer"] == name1
    )
    if profile == "dram":
        # One READ per received expert (both tensors in one request) from ranks 0 and 2: posted and completed.
        assert reads == [(0, "xfer.done"), (0, "xfer.post"), (2, "xfer.done"), (2, "xfer.post")]
        # Rank 0 got expert 2 from rank 1's deregistered memory with the right bytes, and expert 3 from rank 2:
        # nothing on cma notices.  It never used them: rank 1 failed, so the layer's barrier timed out.
        assert w.results["buffer0"] == [sig(0, 0, 2), sig(0, 0, 3)]
    else:
        assert reads == []  # the post fails its key check before anything is sent (no xfer.post event)


@pytest.mark.parametrize("profile", ["rdma", "dram"])
def test_d_shared_agent_survives_the_same_schedule(profile: str) -> None:
    w = run_world("shared-agent", one_rank_drops_old, profile=profile)
    assert [kind for phase, kind, _ in w.events if phase == "drop"] == []  # dropping the old one touched nothing
    assert {r: w.results[r] for r in range(WORLD)} == {0: "ok", 1: "ok", 2: "ok"}


# -- (f) the simplification's premise: "expert weights and expert_buffer keep their storage" ---------------------
@pytest.mark.parametrize(
    "strategy, profile, outcome",
    [
        ("per-communicator-agent", "dram", "ok"),
        ("arena-registry", "dram", "ok"),  # the new range is not covered: a second arena agent registers everything
        ("shared-agent", "dram", "nixlNotFoundError"),  # the new buffer was never registered: the first READ fails
        ("arena-registry", "rocm-strict", "nixlBackendError"),  # ...and that second agent re-registers the weights
    ],
)
def test_f_a_reallocated_expert_buffer(strategy: str, profile: str, outcome: str) -> None:
    """vLLM main@06-21's switch_and_prepare reallocated ``expert_buffer``; newer code reuses it.  Only the
    strategies that register at every creation survive a reallocation."""

    def body(w: World, rank: int) -> None:
        weights, buffer = make_weights(rank, P0)
        old = w.factories[rank](w.groups[0][rank], weights, buffer)
        move(old, rank, weights, buffer, P0, P1)
        buffer = [torch.full((LOCAL, HIDDEN), -7.0) for _ in range(TENSORS)]
        try:
            new = w.factories[rank](w.groups[1][rank], weights, buffer, prev_communicator=old)
            del old
            move(new, rank, weights, buffer, P1, P2)
            w.results[rank] = "ok" if not wrong_rows(rank, weights, P2) else "wrong"
        except Exception as exc:  # noqa: BLE001 - the outcome is the finding
            w.results[rank] = type(exc).__name__

    w = run_world(strategy, body, profile=profile)
    assert w.results == {0: outcome, 1: outcome, 2: outcome}


# -- (e) plugins ------------------------------------------------------------------------------------------------
def test_e_unknown_strategy_lists_the_builtins() -> None:
    with pytest.raises(UnknownStrategy) as info:
        plugins.load("shared_agent")
    assert str(info.value) == (
        "strategy 'shared_agent' not found; known: per-communicator-agent, "
        "per-communicator-agent-deferred, arena-registry, shared-agent, vllm[:PATH], "
        "vllm+shared-agent[:PATH], or package.module:factory"
    )
    assert isinstance(info.value, LookupError)


@pytest.mark.parametrize(
    "source, message",
    [
        (
            "def create(group, w, b):\n    pass\n",
            "is not a strategy factory: create(group, w, b) cannot be called as "
            "factory(group, expert_weights, expert_buffer, prev_communicator), which returns an EPLB communicator (too "
            "many positional arguments)",
        ),
        ("def create(group, w, b, prev=None, *, extra):\n    pass\n", "(missing a required argument: 'extra')"),
        ("x = 1\n", "'bad_factory' has no callable 'create'"),
        ("def create(\n", "importing 'bad_factory' failed: SyntaxError"),
    ],
)
def test_e_a_factory_that_cannot_be_called_as_workers_call_it_is_refused_at_load(
    source, message, tmp_path, monkeypatch
) -> None:
    """Before, a factory without the fourth argument loaded fine and every rank crashed inside the run."""
    (tmp_path / "bad_factory.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UnknownStrategy, match=re.escape(message)) as info:
        plugins.load("bad_factory:create")
    assert str(info.value).startswith("strategy 'bad_factory:create'") and "\n" not in str(info.value)
    for builtin in plugins.BUILTIN:  # the built-ins take what workers pass
        plugins.load(builtin)


def test_e_module_factory_loads_the_broken_strategy() -> None:
    factory = plugins.load(BROKEN)
    assert factory.__name__ == "create"
    assert factory.__globals__["BrokenSharedAgentCommunicator"].__name__ == "BrokenSharedAgentCommunicator"
    # A fresh instance of the user's package: not the one the test session imported.
    assert factory.__module__ == "tests.strategies.broken_shared_agent"
    import tests.strategies.broken_shared_agent as shared_instance

    assert factory.__globals__ is not vars(shared_instance)


def test_e_a_factory_exported_from_a_package_loads_its_defining_module_afresh(tmp_path, monkeypatch) -> None:
    """``mypkg:create`` with ``from .impl import create`` in the package's ``__init__`` (the fresh instance of an
    ``__init__`` must be able to import relatively).  Each load gets its own ``mypkg.impl``, whose module-level
    registry is the process-wide state a strategy keeps."""
    pkg = tmp_path / "exported_strategy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .impl import create\n")
    (pkg / "impl.py").write_text("REGISTRY = {}\n\n\ndef create(group, w, b, prev=None):\n    return REGISTRY\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first, second = plugins.load("exported_strategy:create"), plugins.load("exported_strategy:create")
    assert first.__module__ == "exported_strategy.impl" and "exported_strategy" not in sys.modules
    assert first(None, None, None) is not second(None, None, None)  # two processes, two registries
    with pytest.raises(UnknownStrategy, match="'json' has no callable 'create'"):
        plugins.load("json:create")  # a package whose __init__ imports relatively: found, and said plainly


def test_e_two_loads_have_independent_module_state() -> None:
    first, second = plugins.load("arena-registry"), plugins.load("arena-registry")
    assert first.__globals__["_ARENA_AGENTS"] is not second.__globals__["_ARENA_AGENTS"]
    kernel = Kernel(seed=0)
    fabric = FakeFabric()
    weights, buffer = make_weights(0, P0)
    with fakes.installed(fabric):
        group = Rendezvous(kernel, "eplb#0", [0], timeout_s=300).groups()[0]
        a = first(group, weights, buffer)
        b = first(group, weights, buffer)  # same process (module instance), same arena: reused
        assert (len(fabric.conns), len(first.__globals__["_ARENA_AGENTS"])) == (1, 1)
        assert a.nixl_wrapper is b.nixl_wrapper
        c = second(group, weights, buffer)  # another module instance: its own registry, its own agent
        assert (len(fabric.conns), len(second.__globals__["_ARENA_AGENTS"])) == (2, 1)
        assert c.nixl_wrapper is not a.nixl_wrapper
        del a
        assert len(fabric.conns) == 2  # b still uses the first arena
        del b, c
        assert (len(fabric.conns), first.__globals__["_ARENA_AGENTS"], second.__globals__["_ARENA_AGENTS"]) == (
            0,
            {},
            {},
        )
