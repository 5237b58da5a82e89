"""One client, two NIXLs: a vLLM-style EPLB reader must pass unchanged on the fake and on the real NIXL 1.5.1.

``client_world`` (local to this module on purpose) decides what ``import nixl._api`` means for the test: the fake,
in a fresh :class:`FakeFabric`, or the real wheel, checked not to be the fake.  ``EplbReader`` imports
``nixl._api`` in its constructor, so nothing in the client or in the test body knows which one it got.

World: 3 ranks in one process (one agent each), 2 layers of 2 expert tensors, 2 local experts per rank, so 6
logical experts per layer.  Every expert row is filled with a signature ``layer*100 + tensor*10 + expert``, so a row
that arrives from the wrong rank, row, layer or tensor (or does not arrive) shows up in the assertions.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

import fakes.install
from fakes.nixl import FakeFabric
from tests.conftest import REQUIRE_REAL_NIXL, real_nixl_or_skip

try:
    from .eplb_reader import EplbReader
except ImportError:  # collected without the tests package (rootdir-less run): import it from beside this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from eplb_reader import EplbReader  # type: ignore[no-redef]  # the same class, reached by another name

WORLD = 3
LAYERS = 2
LOCAL = 2
SHAPES = [(4, 8), (16,)]  # per-expert shapes of the two tensors of a layer

IDENTITY = [list(range(WORLD * LOCAL)) for _ in range(LAYERS)]
# Physical slot -> logical expert.  Every expert changes rank, so every rank reads each of its experts from a peer.
FIRST = [
    [3, 2, 5, 4, 1, 0],  # layer 0: rank r takes rank r+1's experts, rows swapped
    [5, 2, 0, 4, 3, 1],
]  # layer 1: each rank reads from both peers


# -- which NIXL ----------------------------------------------------------------------------------------------------
@pytest.fixture(params=["fake", "real"], ids=["fake", "real"])
def client_world(request):
    """Yields "fake" or "real"; for the duration of the test ``nixl._api`` is that implementation."""
    if request.param == "fake":
        with fakes.install.installed(FakeFabric()):
            api = importlib.import_module("nixl._api")
            assert fakes.install.is_fake(api)
            yield "fake"
        return
    real_nixl_or_skip()  # no real NIXL at all: a skip, or a failure under EPSIM_REQUIRE_REAL_NIXL=1 (CI)
    try:  # the client imports ``nixl._api``, which the ``nixl`` meta package maps to the installed wheel
        api = importlib.import_module("nixl._api")
    except Exception as exc:  # ImportError, or a wheel whose native part does not load here
        reason = f"the client imports nixl._api, which does not import here ({exc!r}); install the nixl package"
        if REQUIRE_REAL_NIXL:
            pytest.fail(f"EPSIM_REQUIRE_REAL_NIXL=1 but {reason}")
        pytest.skip(reason)
    assert sys.modules["nixl._api"] is api
    assert not fakes.install.is_fake(sys.modules["nixl._api"]), "the fake NIXL is installed; expected the real one"
    yield "real"


# -- helpers -------------------------------------------------------------------------------------------------------
def signature(layer: int, tensor: int, expert: int) -> float:
    return float(layer * 100 + tensor * 10 + expert)


def make_weights(rank: int, layout: list[list[int]]) -> list[list[torch.Tensor]]:
    weights = []
    for layer in range(LAYERS):
        tensors = []
        for t, shape in enumerate(SHAPES):
            w = torch.empty((LOCAL, *shape), dtype=torch.float32)
            for row in range(LOCAL):
                w[row].fill_(signature(layer, t, layout[layer][rank * LOCAL + row]))
            tensors.append(w)
        weights.append(tensors)
    return weights


def make_buffer() -> list[torch.Tensor]:
    return [torch.full((LOCAL, *shape), -1.0, dtype=torch.float32) for shape in SHAPES]


class World:
    """WORLD readers in one process; ``layout[layer][slot]`` is where every logical expert is now."""

    def __init__(self) -> None:
        self.layout = [list(row) for row in IDENTITY]
        self.weights = [make_weights(r, self.layout) for r in range(WORLD)]
        self.buffers = [make_buffer() for _ in range(WORLD)]
        self.readers = [EplbReader(r, WORLD, self.weights[r], self.buffers[r]) for r in range(WORLD)]
        mds = [rd.metadata() for rd in self.readers]  # stands in for all_gather_object
        metas = [rd.send_meta() for rd in self.readers]
        for rd in self.readers:
            rd.connect(mds, metas)

    def close(self) -> None:
        for rd in self.readers:
            rd.close()

    def rebalance(self, new_layout: list[list[int]], ranks: list[int] | None = None) -> None:
        """vLLM's per-layer loop: every rank reads, (barrier), check the buffer, copy it into the weights."""
        ranks = list(range(WORLD)) if ranks is None else ranks
        for layer in range(LAYERS):
            old = self.layout[layer]
            # Slots of ranks outside ``ranks`` (a closed reader) are empty in the old layout: nothing to read there.
            old_indices = [e if s // LOCAL in ranks else -1 for s, e in enumerate(old)]
            for buf in (self.buffers[r] for r in ranks):
                for b in buf:
                    b.fill_(-1.0)
            for r in ranks:
                reader = self.readers[r]
                reader.set_transfer_context(torch.tensor(old_indices), layer)
                for row in range(LOCAL):
                    expert = new_layout[layer][r * LOCAL + row]
                    src_rank = old_indices.index(expert) // LOCAL
                    assert src_rank != r, "test layouts move every expert to another rank"
                    reader.add_send([], src_rank, expert)  # vLLM calls it on the sender; a no-op for NIXL
                    reader.add_recv([b[row] for b in self.buffers[r]], src_rank, expert)
                reader.execute()
            # Barrier passed: every rank got its rows before anyone overwrites the weights peers read from.
            for r in ranks:
                for t, b in enumerate(self.buffers[r]):
                    for row in range(LOCAL):
                        expected = signature(layer, t, new_layout[layer][r * LOCAL + row])
                        assert torch.equal(b[row], torch.full_like(b[row], expected)), (
                            f"rank {r} layer {layer} tensor {t} row {row}: expected {expected}, got "
                            f"{b[row].flatten()[:4].tolist()}..."
                        )
                    self.weights[r][layer][t].copy_(b)
            self.layout[layer] = [new_layout[layer][s] if s // LOCAL in ranks else old[s] for s in range(WORLD * LOCAL)]

    def assert_weights(self, ranks: list[int] | None = None) -> None:
        for r in range(WORLD) if ranks is None else ranks:
            for layer in range(LAYERS):
                for t in range(len(SHAPES)):
                    got = sorted({float(v) for v in self.weights[r][layer][t].flatten().tolist()})
                    want = sorted({signature(layer, t, e) for e in self.layout[layer][r * LOCAL : (r + 1) * LOCAL]})
                    assert got == want, f"rank {r} layer {layer} tensor {t}: {got} != {want}"
                    for row in range(LOCAL):
                        expected = signature(layer, t, self.layout[layer][r * LOCAL + row])
                        assert torch.all(self.weights[r][layer][t][row] == expected)


@pytest.fixture
def world(client_world):
    w = World()
    yield w
    w.close()


# -- tests ---------------------------------------------------------------------------------------------------------
def test_reader_uses_the_selected_nixl(client_world, world):
    api = sys.modules["nixl._api"]
    assert fakes.install.is_fake(api) == (client_world == "fake")
    for r, rd in enumerate(world.readers):
        assert isinstance(rd.agent, api.nixl_agent)
        assert rd.name.startswith(f"eplb-{r}-") and len(rd.name) == len(f"eplb-{r}-") + 8
        assert sorted(rd._remote_agents) == [p for p in range(WORLD) if p != r]
        assert {world.readers[p].name for p in rd._remote_agents} == set(rd._remote_agents.values())
        # The send meta points at this rank's own weight tensors, one expert row per stride.
        for (layer, t), (ptr, stride, dev) in rd.send_meta().items():
            w = world.weights[r][layer][t]
            assert (ptr, stride, dev) == (w.data_ptr(), w[0].numel() * 4, 0)


def test_first_rebalance_reads_every_moved_expert(client_world, world):
    world.rebalance(FIRST)
    world.assert_weights()
    for rd in world.readers:
        assert rd._pending == [] and rd._dlists == []


def test_second_rebalance_reuses_the_readers(client_world, world):
    world.rebalance(FIRST)
    # Back to the identity: the readers are reused, their handles were released and are made anew, and the READs
    # must see the weights as they are now (updated in place by the first rebalance), not as they were registered.
    world.rebalance(IDENTITY)
    world.assert_weights()
    assert world.layout == IDENTITY
    world.rebalance(FIRST)
    world.assert_weights()


def test_closed_reader_leaves_the_others_working(client_world, world):
    world.rebalance(FIRST)
    gone = world.readers[2]
    gone.close()
    assert gone.agent is None and gone._remote_agents == {}
    gone.close()  # idempotent
    # Ranks 0 and 1 swap everything they hold; rank 2's slots are -1 in old_indices and are not read.
    second = [
        [
            world.layout[n][2],
            world.layout[n][3],
            world.layout[n][0],
            world.layout[n][1],
            world.layout[n][4],
            world.layout[n][5],
        ]
        for n in range(LAYERS)
    ]
    world.rebalance(second, ranks=[0, 1])
    world.assert_weights(ranks=[0, 1])
    assert world.layout == second
    # Rank 2's memory is untouched by the survivors' rebalance.
    for layer in range(LAYERS):
        for t in range(len(SHAPES)):
            for row in range(LOCAL):
                assert torch.all(world.weights[2][layer][t][row] == signature(layer, t, FIRST[layer][4 + row]))


def _read_from_closed_rank(world: World):
    """Rank 2 leaves; rank 0 then tries to READ expert 3 of layer 1, which old_indices still place on rank 2."""
    world.rebalance(FIRST)  # every endpoint has carried a READ: the peers are wired up
    world.readers[2].close()
    bindings = importlib.import_module("nixl._bindings")  # the fake's or the real one, like nixl._api
    reader, buf = world.readers[0], world.buffers[0]
    for b in buf:
        b.fill_(-1.0)
    old = world.layout[1]
    reader.set_transfer_context(old, 1)
    assert old.index(3) // LOCAL == 2
    with pytest.raises(bindings.nixlRemoteDisconnectError):
        reader.add_recv([b[0] for b in buf], 2, 3)
    # The READ failed, but whether its bytes landed is a race on real NIXL: the closed reader's tensors are still
    # mapped in this process and UCX sometimes copies them before the endpoint's failure is seen (about one run
    # in four under pytest).  The fake never copies.  A client must treat the row as garbage; what can be checked
    # is that nothing else was touched and that no descriptor was half-copied.
    for t, b in enumerate(buf):
        row = sorted(set(b[0].flatten().tolist()))
        assert row in ([-1.0], [signature(1, t, 3)]), f"tensor {t}: row 0 holds {row}"
        assert torch.all(b[1] == -1.0), f"tensor {t}: row 1 was written"
    return bindings, reader, buf


def test_read_from_closed_reader_fails_at_post_and_the_reader_recovers(client_world, world):
    bindings, reader, buf = _read_from_closed_rank(world)
    # The failed request is still pending; execute() reports the disconnect again and releases every handle.
    with pytest.raises(bindings.nixlRemoteDisconnectError):
        reader.execute()
    assert reader._pending == [] and reader._dlists == []
    # The same reader still reads from the live rank 1 (expert 4 of layer 1 sits in rank 1's row 1 after FIRST).
    old = world.layout[1]
    reader.set_transfer_context(old, 1)
    assert old.index(4) // LOCAL == 1
    reader.add_recv([b[1] for b in buf], 1, 4)
    reader.execute()
    for t, b in enumerate(buf):
        assert torch.all(b[1] == signature(1, t, 4))


def test_check_after_failed_post_reports_remote_disconnect(client_world, world):
    """Real NIXL 1.5.1 keeps REMOTE_DISCONNECT as the request's state when its post fails that way, so the next
    check_xfer_state raises nixlRemoteDisconnectError again (the fake once left the request NEW)."""
    bindings, reader, _ = _read_from_closed_rank(world)
    got: Exception | None
    try:
        reader.execute()
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        got = exc
    else:
        got = None
    assert isinstance(got, bindings.nixlRemoteDisconnectError), f"execute() raised {got!r}"
