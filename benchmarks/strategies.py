"""A careful shared-agent strategy and three deliberately broken copies, for the time-to-detect benchmark.

``careful`` is ``shared-agent`` with the three fixes its users would add first:

- storage moved: the successor registers any expert tensor the shared agent has not registered (``storage.move``);
- restarted peer: ``add_remote_agent`` refused with NOT_ALLOWED (a known name with a new connection) removes the
  stale entry and loads the name again (``peer.restart``);
- departed peers: the successor learns its group's agent names when it is built (an ``all_gather_object`` on the
  new group, which PREPARE runs on every new member), and the communicator it replaces, when finalized, removes
  every peer the shared agent loaded that is not among them.  The removal happens when the old communicator dies:
  a finalizer the collector delays leaves departed peers loaded for a while (the ``stale_peer`` oracle sees that
  under ``gc.late``, ``gc.cycle`` and ``gc.never``), which is the point of simulating GC.

Each ``broken_*`` takes one fix away or adds one mistake; the benchmark counts the swarm seeds until a broken copy
fails where ``careful`` passes on the same seed.  Written against ``nixl._api`` and ``torch.distributed`` only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch.distributed as dist

from sim.eplb.communicators.nixl_read import as_name
from sim.eplb.communicators.shared_agent import SharedAgentNixlCommunicator


class _Shared:
    """What every communicator on one shared agent knows: the ranges it registered, the peers it loaded."""

    def __init__(self) -> None:
        self.registered: set[tuple[int, int, int]] = set()
        self.loaded: set[str] = set()


def _desc_keys(descs: Any) -> list[tuple[int, int, int]]:
    return [(int(descs[i][0]), int(descs[i][1]), int(descs[i][2])) for i in range(descs.descCount())]


class CarefulSharedAgent(SharedAgentNixlCommunicator):
    reregister = True  # register tensors the shared agent has not registered (storage moved)
    clean_peers = True  # the replaced communicator's finalizer removes departed peers
    deregister_on_del = False  # the mistake: a finalizer that deregisters the shared registrations

    def __init__(
        self,
        group: Any,
        expert_weights: Sequence[Sequence[Any]],
        expert_buffer: Sequence[Any],
        prev_communicator: Any = None,
    ) -> None:
        super().__init__(group, expert_weights, expert_buffer, prev_communicator)
        agent = self.nixl_wrapper
        self._successor_names: set[str] | None = None
        if prev_communicator is None:
            self._shared = _Shared()
            self._shared.registered.update(_desc_keys(self._registered_descs))
        else:
            self._shared = prev_communicator._shared
            if self.reregister:
                descs = agent.get_reg_descs(self._tensors(), self._mem)
                fresh = [d for d in _desc_keys(descs) if d not in self._shared.registered]
                if fresh:
                    agent.register_memory(agent.get_reg_descs([(a, n, d, "") for a, n, d in fresh], self._mem))
                    self._shared.registered.update(fresh)
        # The group's agent names, so that the communicator this one replaces can drop the others.  Every member
        # builds its communicator at once (PREPARE on the old ranks, start on the joining ones): a collective here
        # is safe.
        names: list[Any] = [None] * self._world
        dist.all_gather_object(names, agent.name, group=self._group)
        if prev_communicator is not None:
            prev_communicator._successor_names = set(names)

    def _load_peers(self) -> list[str]:
        agent = self.nixl_wrapper
        gathered: list[Any] = [None] * self._world
        dist.all_gather_object(gathered, (agent.name, agent.get_agent_metadata()), group=self._group)
        names = []
        for r, (name, metadata) in enumerate(gathered):
            if r == self._rank:
                names.append(agent.name)
                continue
            try:
                names.append(as_name(agent.add_remote_agent(metadata)))
            except Exception as exc:  # noqa: BLE001 - only NOT_ALLOWED is expected
                if type(exc).__name__ != "nixlNotAllowedError":
                    raise
                agent.remove_remote_agent(name)  # a restarted peer: same name, new connection
                names.append(as_name(agent.add_remote_agent(metadata)))
            self._shared.loaded.add(name)
        return names

    def __del__(self) -> None:
        super().__del__()
        agent = getattr(self, "nixl_wrapper", None)
        if agent is None:
            return
        keep = getattr(self, "_successor_names", None)
        shared = getattr(self, "_shared", None)
        if self.clean_peers and keep is not None and shared is not None:
            for name in sorted(shared.loaded - keep):
                with contextlib.suppress(Exception):  # a restarted agent may have forgotten it already
                    agent.remove_remote_agent(name)
                shared.loaded.discard(name)
        if self.deregister_on_del and self._registered_descs is not None:
            with contextlib.suppress(Exception):
                agent.deregister_memory(self._registered_descs)


class BrokenFinalizer(CarefulSharedAgent):
    deregister_on_del = True


class BrokenNoReregister(CarefulSharedAgent):
    reregister = False


class BrokenPeerCache(CarefulSharedAgent):
    clean_peers = False


def careful(group, expert_weights, expert_buffer, prev_communicator=None):
    return CarefulSharedAgent(group, expert_weights, expert_buffer, prev_communicator)


def broken_finalizer(group, expert_weights, expert_buffer, prev_communicator=None):
    return BrokenFinalizer(group, expert_weights, expert_buffer, prev_communicator)


def broken_no_reregister(group, expert_weights, expert_buffer, prev_communicator=None):
    return BrokenNoReregister(group, expert_weights, expert_buffer, prev_communicator)


def broken_peer_cache(group, expert_weights, expert_buffer, prev_communicator=None):
    return BrokenPeerCache(group, expert_weights, expert_buffer, prev_communicator)


BROKEN = {
    "finalizer deregisters shared memory": "benchmarks.strategies:broken_finalizer",
    "reused agent never re-registers moved storage": "benchmarks.strategies:broken_no_reregister",
    "peer cache never cleaned": "benchmarks.strategies:broken_peer_cache",
}
CAREFUL = "benchmarks.strategies:careful"
