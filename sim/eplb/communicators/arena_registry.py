"""``arena-registry``: the first fix (vLLM PR #63134): one NIXL agent per process and memory arena.

Code under test: written against ``nixl._api`` and ``torch.distributed`` only, so it runs unchanged on the fakes
and on real NIXL.

A module-global (so per-process) registry ``_ARENA_AGENTS`` maps ``(device, lo, hi)`` (the lowest start and the
highest end address of every registered tensor) to an :class:`_ArenaAgent`: the NIXL agent, the ranges it
registered, a user count and a cache of the remote agents it has already loaded.  A new communicator whose tensors
an arena agent already covers borrows it (users += 1) instead of registering the same pages again; otherwise it
makes a new agent, registers and records it.  Remote setup skips ``add_remote_agent`` for names in the cache.  A
communicator's ``__del__`` releases its transfer handles and drops its use; the last user deregisters, removes every
remote agent the arena loaded and drops the registry entry, after which refcounting destroys the agent.

Data path as in vLLM 0.33 (receiver-initiated READs, remote setup deferred to the first ``set_transfer_context``),
shared with the other strategies in :mod:`sim.eplb.communicators.nixl_read`.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Sequence

import torch.distributed as dist

from sim.eplb.communicators.base import EplbCommunicator
from sim.eplb.communicators.nixl_read import NixlReadCommunicator, as_name


def _ranges(tensors: Sequence[Any]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]


class _ArenaAgent:
    """A NIXL agent shared by every communicator of this process whose tensors lie in the ranges it registered."""

    def __init__(
        self, key: tuple[str, int, int], agent: Any, registered_descs: Any, registered_ranges: list[tuple[int, int]]
    ) -> None:
        self.key = key
        self.agent = agent
        self.registered_descs = registered_descs
        self.registered_ranges = list(registered_ranges)
        self.users = 0
        self.remote_names: set[str] = set()

    def covers(self, ranges: Sequence[tuple[int, int]]) -> bool:
        return all(any(lo <= a and b <= hi for lo, hi in self.registered_ranges) for a, b in ranges)

    def __repr__(self) -> str:
        return f"<_ArenaAgent {self.agent.name!r} users={self.users} ranges={len(self.registered_ranges)}>"


_ARENA_AGENTS: dict[tuple[str, int, int], _ArenaAgent] = {}


def _acquire_arena(rank: int, tensors: list[Any], mem: str) -> _ArenaAgent:
    from nixl._api import nixl_agent, nixl_agent_config

    ranges = _ranges(tensors)
    key = (str(tensors[0].device), min(lo for lo, _ in ranges), max(hi for _, hi in ranges))
    arena = _ARENA_AGENTS.get(key)
    if arena is None or not arena.covers(ranges):
        agent = nixl_agent(f"eplb-{rank}-{uuid.uuid4().hex[:8]}", nixl_agent_config(capture_telemetry=False))
        descs = agent.get_reg_descs(tensors, mem)
        agent.register_memory(descs)
        arena = _ArenaAgent(key, agent, descs, ranges)
        _ARENA_AGENTS[key] = arena
    arena.users += 1
    return arena


def _release_arena(arena: _ArenaAgent) -> None:
    arena.users -= 1
    if arena.users > 0:
        return
    with contextlib.suppress(Exception):
        arena.agent.deregister_memory(arena.registered_descs)
    for name in sorted(arena.remote_names):
        with contextlib.suppress(Exception):
            arena.agent.remove_remote_agent(name)
    arena.remote_names.clear()
    if _ARENA_AGENTS.get(arena.key) is arena:
        del _ARENA_AGENTS[arena.key]


class ArenaNixlCommunicator(NixlReadCommunicator):
    """A communicator borrowing its process's arena agent."""

    def __init__(self, group: Any, expert_weights: Sequence[Sequence[Any]], expert_buffer: Sequence[Any]) -> None:
        super().__init__(group, expert_weights, expert_buffer)
        tensors = self._tensors()
        self._arena = _acquire_arena(self._rank, tensors, self._mem)
        self.nixl_wrapper = self._arena.agent

    # -- remote setup -----------------------------------------------------------------------------------------
    def _load_peers(self) -> list[str]:
        """Like every strategy, but ``add_remote_agent`` only for names the arena has not loaded yet."""
        agent = self.nixl_wrapper
        gathered: list[Any] = [None] * self._world
        dist.all_gather_object(gathered, (agent.name, agent.get_agent_metadata()), group=self._group)
        names = []
        for r, (name, metadata) in enumerate(gathered):
            if r != self._rank and name not in self._arena.remote_names:
                name = as_name(agent.add_remote_agent(metadata))
                self._arena.remote_names.add(name)
            names.append(name)
        return names

    def __del__(self) -> None:
        arena = getattr(self, "_arena", None)
        if arena is None:
            return
        self._xfer_handles = []
        self._release_handles(quiet=True)
        del self._arena
        with contextlib.suppress(Exception):
            _release_arena(arena)


def create(
    group: Any,
    expert_weights: Sequence[Sequence[Any]],
    expert_buffer: Sequence[Any],
    prev_communicator: EplbCommunicator | None = None,
) -> ArenaNixlCommunicator:
    """#63134 finds the agent through the registry, not through ``prev_communicator`` (accepted and ignored)."""
    return ArenaNixlCommunicator(group, expert_weights, expert_buffer)
