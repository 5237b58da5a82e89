"""Peers: loading metadata, removing peers, checking them, and notifications.

Facts reproduced (docs/reference/nixl-1.5.1.md, facts 1, 10, 12-14, 26, 30, 31): a name comes back as bytes; the same
connection loaded again is a no-op success whose sections are merged (never removed); a new connection under a known
name is NOT_ALLOWED until the peer is removed; a destroyed or killed peer stays "known" (``check_remote_metadata`` is
True) and every post or notification towards it raises ``nixlRemoteDisconnectError``; removing a peer invalidates
handles made towards it. Observed on 1.5.1 since (the catalogue's ``peer_gone_before_load`` and ``own_name``): loading
the metadata of an agent that is already gone is ``nixlBackendError`` (UCX connects while loading) and leaves no peer;
an agent knows its own name (checked with no descriptors, and as a notification target)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import _status as S
from ._parts import AgentParts
from ._memory import SectionTable, decode_md


@dataclass
class Peer:
    name: str
    conn: str | None
    # What this agent knows of the peer's registrations.  Immutable and shared: in an EP group every rank loads the
    # same metadata of every other rank, so N agents hold one table per peer instead of N copies (at EP64 that is
    # the difference between a million section entries and fifteen thousand).  A merge makes a new table.
    table: SectionTable = SectionTable.EMPTY
    generation: int = 0
    failed: bool = False  # the endpoint failed: every later operation towards it raises RemoteDisconnect
    wired: bool = False  # a transfer towards it has completed: the endpoint is connected

    def covers(self, mem: int, addr: int, length: int, dev: int):
        return self.table.index.find((mem, dev), addr, length)


class PeersMixin(AgentParts):
    def _init_peers(self) -> None:
        self.peers: dict[str, Peer] = {}
        self.inbox: list[tuple[str, bytes]] = []  # (sender name, message), in arrival order
        self.wired_to_self = False  # loopback endpoint connected
        self.loaded_a_peer = False  # the first add_remote_agent costs more (time model)

    def loadRemoteMD(self, metadata: bytes) -> bytes:
        model = self.fabric.time_model
        self.fabric.host_time(
            model.remote_setup_s if self.loaded_a_peer else model.first_remote_setup_s, "loading a remote agent"
        )
        self.loaded_a_peer = True
        self._enter()
        name, conn, table = decode_md(metadata)
        if name == self.name:
            S.fail(S.INVALID_PARAM, "loadRemoteMD: remote agent name same as local agent, no need to load metadata")
        peer = self.peers.get(name)
        if peer is not None and conn is not None and peer.conn is not None and peer.conn != conn:
            S.fail(
                S.NOT_ALLOWED,
                f"loadRemoteMD: remote agent '{name}' already loaded with different connection info; remove it first",
            )
        if peer is None:
            if conn is None:
                S.fail(S.NOT_FOUND, f"loadRemoteMD: no connection info for unknown remote agent '{name}'")
            if self.fabric.live_agent(conn) is None:
                # UCX connects to the peer's worker while loading: an agent that is gone (destroyed, its process
                # exited or killed) refuses, and the peer is not added (a retry fails the same way).
                S.fail(
                    S.BACKEND,
                    f"loadRemoteMD: cannot connect to remote agent '{name}' (connection refused): the agent is gone",
                )
            peer = Peer(name, conn, generation=self.fabric.new_id())
            adding = True
        else:
            adding = False
        if self.fabric.profile.refuse_changed_keys and peer.table.rekeys(table):
            S.fail(
                S.NOT_ALLOWED,
                f"loadRemoteMD: remote agent '{name}' sent a new key for a known descriptor; "
                "metadata updates are not allowed",
            )
        peer.table = peer.table.merged(table)  # merged, never removed
        if peer.conn is None:
            peer.conn = conn
        if adding:
            self.peers[name] = peer
        self.fabric.emit(
            "peer.load",
            agent=self.name,
            pid=self.pid,
            conn=self.conn,
            peer=name,
            peer_conn=peer.conn,
            sections=table.count,
        )
        return name.encode()

    def invalidateRemoteMD(self, name: str) -> S.nixl_status_t:
        self._enter()
        if self.peers.pop(name, None) is not None:
            self.fabric.emit("peer.remove", agent=self.name, pid=self.pid, conn=self.conn, peer=name)
        return S.nixl_status_t.NIXL_SUCCESS

    def checkRemoteMD(self, name: str, descs: Any) -> S.nixl_status_t:
        self._enter()
        triples = self._xfer_triples(descs, "checkRemoteMD")
        if name == self.name:
            # 1.5.1 knows its own name, with no remote sections under it: True for no descriptors, else False.
            return S.nixl_status_t.NIXL_ERR_NOT_FOUND if triples else S.nixl_status_t.NIXL_SUCCESS
        peer = self.peers.get(name)
        if peer is None:
            return S.nixl_status_t.NIXL_ERR_NOT_FOUND
        mem = int(descs.getType())
        for addr, length, dev in triples:
            if peer.covers(mem, addr, length, dev) is None:
                return S.nixl_status_t.NIXL_ERR_NOT_FOUND
        return S.nixl_status_t.NIXL_SUCCESS

    def makeConnection(self, name: str, backends: list | None = None) -> S.nixl_status_t:
        self._enter()
        if name not in self.peers:
            S.fail(S.NOT_FOUND, f"makeConnection: metadata for remote agent '{name}' not found")
        return S.nixl_status_t.NIXL_SUCCESS

    # -- reachability -----------------------------------------------------------------------------------------
    def _target(self, peer: Peer):
        """The live agent behind ``peer``, or None if it is gone (destroyed, killed, or its endpoint failed)."""
        return None if peer.failed else self.fabric.live_agent(peer.conn)

    def _fail_endpoint(self, peer: Peer, why: str) -> None:
        peer.failed = True
        self.fabric.emit("peer.fail", agent=self.name, pid=self.pid, peer=peer.name, why=why)

    # -- notifications ----------------------------------------------------------------------------------------
    def genNotif(self, name: str, msg: bytes | str, backend: int | None = None) -> S.nixl_status_t:
        self._enter()
        if name == self.name:  # to itself, over the loopback endpoint
            self._send_notif(self, name, msg)
            return S.nixl_status_t.NIXL_SUCCESS
        peer = self.peers.get(name)
        if peer is None:
            S.fail(S.NOT_FOUND, "genNotif: no specified or potential backend could send the inter-agent notifications")
        target = self._target(peer)
        if target is None:
            S.fail(S.REMOTE_DISCONNECT, f"genNotif: remote agent '{name}' is disconnected")
        self._send_notif(target, peer.name, msg)
        return S.nixl_status_t.NIXL_SUCCESS

    def _send_notif(self, target, peer_name: str, msg: bytes | str) -> None:
        data = msg.encode() if isinstance(msg, str) else bytes(msg)
        faults = self.fabric.faults
        if faults.take("notif.drop", self.name, peer_name, pid=self.pid) is not None:
            return
        delay = self.fabric.notif_delay()
        late = faults.take("notif.delay", self.name, peer_name, pid=self.pid)
        if late is not None:
            delay += float(late.params.get("delay", 1.0))
        sender = self.name

        def deliver() -> None:
            if not target.destroyed:
                target.inbox.append((sender, data))

        if delay <= 0:
            deliver()
        else:
            self.fabric.schedule(delay, deliver)

    def getNotifs(self, into: dict, backends: list | None = None) -> dict[str, list[bytes]]:
        self._enter()
        out = into if into is not None else {}
        for sender, data in self.inbox:
            out.setdefault(sender, []).append(data)
        self.inbox.clear()
        return out
