"""Strategies that each break one rule an oracle judges, written as a user would (``tests.strategies.oracle_mutants:
NAME``), for tests/sim/test_oracle_mutants.py.

``never_prepares``: PREPARE never returns (the new communicator's constructor waits for ever).
``deregisters_twice``: ``__del__`` releases everything, then deregisters the same memory again (error swallowed).
``raises_after_cleanup``: ``__del__`` releases everything, then raises (Python prints it and goes on).
``loads_peers_eagerly``: shared-agent that loads every peer when it is built and never removes one.
``keeps_agents``: shared-agent that also parks every communicator's agent in a module-level list (a leak).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from sim.eplb.communicators.per_agent import PerAgentNixlCommunicator
from sim.eplb.communicators.shared_agent import SharedAgentNixlCommunicator


class _NeverPrepares(PerAgentNixlCommunicator):
    def __init__(self, group: Any, expert_weights: Any, expert_buffer: Any, prev: Any = None) -> None:
        super().__init__(group, expert_weights, expert_buffer)
        if prev is not None:  # only a PREPARE passes the previous communicator
            time.sleep(1e9)


class _DeregistersTwice(PerAgentNixlCommunicator):
    def __del__(self) -> None:
        descs = getattr(self, "_registered_descs", None)
        super().__del__()
        agent = getattr(self, "nixl_wrapper", None)
        if agent is not None and descs is not None:
            with contextlib.suppress(Exception):
                agent.deregister_memory(descs)


class _RaisesAfterCleanup(PerAgentNixlCommunicator):
    def __del__(self) -> None:
        super().__del__()
        raise RuntimeError("noise after a complete cleanup")


class _LoadsPeersEagerly(SharedAgentNixlCommunicator):
    def __init__(self, group: Any, expert_weights: Any, expert_buffer: Any, prev: Any = None) -> None:
        super().__init__(group, expert_weights, expert_buffer, prev)
        self._init_remote_state()


def never_prepares(group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
    return _NeverPrepares(group, expert_weights, expert_buffer, prev_communicator)


def deregisters_twice(group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
    return _DeregistersTwice(group, expert_weights, expert_buffer)


def raises_after_cleanup(group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
    return _RaisesAfterCleanup(group, expert_weights, expert_buffer)


def loads_peers_eagerly(group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
    return _LoadsPeersEagerly(group, expert_weights, expert_buffer, prev_communicator)


_KEPT: list[Any] = []


def keeps_agents(group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
    comm = SharedAgentNixlCommunicator(group, expert_weights, expert_buffer, prev_communicator)
    _KEPT.append(comm.nixl_wrapper)
    return comm
