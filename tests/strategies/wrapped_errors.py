"""Strategies whose communicator fails to start the way vLLM reports it: the error wrapped twice,
``RuntimeError("Failed to initialize NixlEplbCommunicator (NIXL EPLB init failed: ...)")`` raised ``from``
``RuntimeError("NIXL EPLB init failed: ...")`` raised ``from`` what went wrong underneath.

``create``: underneath, NIXL refuses a connection to an agent it has no metadata of (``nixlNotFoundError``, raised
by the fake in the simulation, by NIXL itself on the real backend).
``create_bad_layout``: underneath, a ``ValueError`` of the strategy's own checks.

Both crash on every rank with the same outer ``RuntimeError``; only the root cause (and where it was raised) tells
the two bugs apart.
"""

from __future__ import annotations

from typing import Any


def _connect_peers(agent: Any) -> None:
    agent.make_connection("eplb-no-such-peer")  # nobody sent this agent's metadata: NIXL_ERR_NOT_FOUND


def _check_layout(expert_weights: Any) -> None:
    raise ValueError(f"expert weights of {len(expert_weights)} layers do not tile the buffer")


class NixlEplbCommunicator:
    def __init__(self, group: Any, expert_weights: Any, expert_buffer: Any, step: str) -> None:
        try:
            self._init_buffers(group, expert_weights, step)
        except Exception as exc:
            raise RuntimeError(f"Failed to initialize NixlEplbCommunicator ({exc})") from exc

    def _init_buffers(self, group: Any, expert_weights: Any, step: str) -> None:
        try:
            if step == "connect":
                from nixl._api import nixl_agent, nixl_agent_config

                agent = nixl_agent(f"eplb-wrapped-{group.rank()}", nixl_agent_config(capture_telemetry=False))
                _connect_peers(agent)
            else:
                _check_layout(expert_weights)
        except Exception as exc:
            raise RuntimeError("NIXL EPLB init failed: buffers") from exc


def create(group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
    return NixlEplbCommunicator(group, expert_weights, expert_buffer, "connect")


def create_bad_layout(group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
    return NixlEplbCommunicator(group, expert_weights, expert_buffer, "layout")
