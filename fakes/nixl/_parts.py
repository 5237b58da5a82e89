"""What the call families (memory, peers, transfers) may use of the agent they are mixed into.

``AgentCore`` is put together from ``MemoryMixin``, ``PeersMixin`` and ``XferMixin``, and each family reads the
core's identity and the others' state.  The families inherit this class so that those names are declared once, with
their types, for the type checker; at run time it adds nothing (annotations only, the helpers' signatures under
``TYPE_CHECKING``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import _status as S
    from ._agent import nixlAgentConfig
    from ._dlist import nixlXferDList
    from ._fabric import FakeFabric
    from ._memory import Region
    from ._peers import Peer
    from ._spans import SpanIndex
    from ._xfer import PreppedDlist, XferReq


class AgentParts:
    # the core (_agent.py)
    name: str
    pid: int
    conn: str
    config: nixlAgentConfig
    telemetry: bool
    fabric: FakeFabric
    destroyed: bool
    backends: dict[int, str]
    # memory (_memory.py)
    regions: list[Region]
    region_index: SpanIndex
    loopback_hidden: list[Region]
    # peers (_peers.py)
    peers: dict[str, Peer]
    inbox: list[tuple[str, bytes]]
    wired_to_self: bool
    loaded_a_peer: bool
    # transfers (_xfer.py)
    dlists: dict[int, PreppedDlist]
    xfers: dict[int, XferReq]
    released_handles: set[int]
    req_owners: dict[Any, int]

    if TYPE_CHECKING:

        def _enter(self) -> None: ...
        def _has_backend_for(self, mem: S.nixl_mem_t) -> bool: ...
        def _refuse_posix_only(self, backends: list | None, call: str) -> None: ...
        def _local_region(self, mem: int, addr: int, length: int, dev: int) -> Region | None: ...
        def _loopback_region(self, mem: int, addr: int, length: int, dev: int) -> Region | None: ...
        def _xfer_triples(self, descs: nixlXferDList, call: str) -> list[tuple[int, int, int]]: ...
        def _target(self, peer: Peer) -> AgentParts | None: ...
        def _fail_endpoint(self, peer: Peer, why: str) -> None: ...
        def _send_notif(self, target: AgentParts, peer_name: str, msg: bytes | str) -> None: ...
