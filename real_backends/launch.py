"""Who starts the rank processes of a real run: this host (``LocalLauncher``), or the slots torchrun started.

Locally, every rank is forked from a zygote that imported torch and NIXL once for the run
(:mod:`real_backends.zygote`), or where that cannot be used is ``python -m real_backends.rank FD``, a child of the
run's process; either way it talks to the run on one end of a socket pair, and everything binds to loopback.

Under torchrun (``epsim run ... --backend real`` started once per slot with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set), slot 0 runs the engine and listens on ``MASTER_ADDR`` at a
port the system picks (``EPSIM_PORT`` fixes it, for a firewall), which it publishes with a random key in the job's
own store; every slot, slot 0's own included (a child process), reads both there, connects, passes a challenge on
the key, and waits. (The earlier fixed choice, ``MASTER_PORT+1``, may be held by any other socket on the host, and
the run then fails at start for no reason of its own.) A rank the scenario starts takes the next waiting slot, on
that slot's GPU (``LOCAL_RANK``); a slot serves one rank and then exits, as a process retired by a scale-down does.
Slots no rank needed are told so at the end. Multi-host addresses are asked for by running under torchrun, so
nothing here forces loopback.

A slot's events are stamped with its host's monotonic clock. A slot on slot 0's kernel (same boot, same time
namespace) reads the very same clock, so its events need no correction; one elsewhere is put on slot 0's clock with
an offset measured at connect by a few request-reply rounds, the round with the shortest round trip giving the
estimate and half that round trip its bound; the slots of one other host share the tightest of their placements, as
they share a clock. (Taking one one-way message's latency as the offset, as epsim first
did, shifted the ranks of one host apart by however long a loaded host took to deliver that message: a few
milliseconds on this 2-core VM, enough for the judge to see a peer's READ land after its source was destroyed.)
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, Callable

from sim.errors import ScenarioError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ACCEPT_TIMEOUT_S = 300.0
HELLO_TIMEOUT_S = 60.0  # a connected slot's hello, and each answer to a clock request
CLOCK_ROUNDS = 16  # request-reply rounds that measure a slot's clock offset when it runs on another kernel


def clock_domain() -> str | None:
    """What names this process's monotonic clock: the kernel's boot and the time namespace; None if unknown.

    CLOCK_MONOTONIC is one clock for every process of one boot of one kernel, containers included, unless a time
    namespace offsets it (Linux 5.6+, rare); two processes with the same domain read the same clock.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return None
    try:
        namespace = os.readlink("/proc/self/ns/time")
    except OSError:  # a kernel without time namespaces: every process shares the boot's clock
        namespace = "time:-"
    return f"{boot}/{namespace}"


def measure_clock_offset(
    conn: Connection, rounds: int = CLOCK_ROUNDS, timeout_s: float = HELLO_TIMEOUT_S
) -> tuple[float, float]:
    """(offset, bound) of the slot on ``conn``: its monotonic clock plus offset is this process's, within bound.

    Each round asks for the slot's clock and times the round trip; the reading was taken somewhere inside it, so the
    midpoint of the shortest round is the estimate and half of that round trip the most it can be off.
    """
    best: tuple[float, float] | None = None
    for _ in range(rounds):
        sent = time.monotonic()
        conn.send(("clock?",))
        if not conn.poll(timeout_s):
            raise TimeoutError("the slot did not answer a clock request")
        theirs = conn.recv()[1]
        back = time.monotonic()
        estimate = ((sent + back) / 2 - theirs, (back - sent) / 2)
        if best is None or estimate[1] < best[1]:
            best = estimate
    assert best is not None
    return best


def place_clock(conn: Connection, info: dict[str, Any], timeout_s: float = HELLO_TIMEOUT_S) -> None:
    """Put the slot's ``clock_offset`` and ``clock_bound`` (seconds) in ``info``, the slot's hello (``timeout_s``:
    for each answer to a clock request)."""
    if info.get("clock_domain") is not None and info["clock_domain"] == clock_domain():
        info["clock_offset"], info["clock_bound"] = 0.0, 0.0  # the same clock: nothing to correct
    else:
        info["clock_offset"], info["clock_bound"] = measure_clock_offset(conn, timeout_s=timeout_s)


def answer_clock(conn: Connection, clock: Callable[[], float] = time.monotonic) -> Any:
    """The slot's side of :func:`measure_clock_offset`: answer clock requests; the first other message, or None
    if the connection closed."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return None
        if msg[0] != "clock?":
            return msg
        conn.send(("clock", clock()))


def receive_hello(conn: Connection, timeout_s: float = HELLO_TIMEOUT_S) -> dict[str, Any] | None:
    """A slot's hello, with its clock placed on this one (:func:`place_clock`); ``timeout_s`` for the hello and for
    each answer to a clock request.  None for a slot that dies or stalls before it is placed (it had the job's key,
    so the caller fails the wait).  A slot of an epsim older than the clock scheme would have its events shifted by a
    message's latency (docs/real-backend.md): refused in one line."""
    try:
        if not conn.poll(timeout_s):
            raise TimeoutError("no hello")
        info = conn.recv()
        if "clock_domain" not in info:
            raise ScenarioError(
                f"torchrun slot {info.get('rank')} runs another version of epsim (its hello has no "
                "clock domain); start every slot from the same epsim"
            )
        place_clock(conn, info, timeout_s)
    except (EOFError, OSError, TimeoutError):
        return None
    return info


def share_clocks(infos: list[dict[str, Any]]) -> None:
    """The slots of one other host read one clock: give them all the placement measured most tightly among them,
    so that their events keep the order they had on that clock (placed one by one, two of them could be pulled
    apart by the sum of their bounds, the error this scheme exists to avoid)."""
    best: dict[Any, dict[str, Any]] = {}  # clock domain -> the slot measured most tightly in it
    for info in infos:
        domain = info.get("clock_domain")
        if (
            domain is not None
            and info["clock_bound"] > 0
            and (domain not in best or info["clock_bound"] < best[domain]["clock_bound"])
        ):
            best[domain] = info
    for info in infos:
        chosen = best.get(info.get("clock_domain"))
        if chosen is not None:
            info["clock_offset"], info["clock_bound"] = chosen["clock_offset"], chosen["clock_bound"]


def _recv_timeout(endpoint: Any, seconds: float | None) -> None:
    """Make a blocking receive on ``endpoint`` (a socket, or a Connection over one) fail after ``seconds`` instead
    of waiting for ever (None: wait for ever again), for the handshake of a connection not yet known to be ours."""
    sec, usec = (0, 0) if seconds is None else divmod(max(1, round(seconds * 1e6)), 1_000_000)  # (0, 0): no limit
    with socket.socket(fileno=os.dup(endpoint.fileno())) as dup:  # the same socket: its options are shared
        dup.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, usec))


class _Child:
    """A local rank process, with the calls the cluster makes (``multiprocessing.Process``'s names)."""

    started_as = "interpreter"  # how the run's history says it was started

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen, self.pid = popen, popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()


def child_env() -> dict[str, str]:
    """The parent's environment; its import path first, so the rank imports the same epsim."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


class _Zygote:
    """The launcher's side of :mod:`real_backends.zygote`: starts it, asks it for ranks, follows their exits."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.usable: bool | None = None  # None until the zygote said ready or unusable
        self.why = ""
        self._cond = threading.Condition()
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._stores: list[int | None] = []  # the store ports the zygote answered (None: it could not listen)
        self._gone = False
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.popen: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-m", "real_backends.zygote", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()],
                cwd=os.getcwd(),
                env=env,
            )
        except OSError as exc:  # the ranks' own start will meet the same error and say so
            self.popen, self.usable, self.why = None, False, f"cannot start the zygote: {exc}"
        finally:
            theirs.close()
        self.sock = mine
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="rank-zygote", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            with self._cond:
                if not data:  # the zygote ended: every rank it had not reported died with it (PR_SET_PDEATHSIG)
                    self._gone = True
                    if self.usable is None:
                        self.usable, self.why = False, "the zygote ended before it was ready"
                    self._cond.notify_all()
                    return
                msg = pickle.loads(data)
                if msg[0] == "ready":
                    self.usable = True
                elif msg[0] == "unusable":
                    self.usable, self.why = False, msg[1]
                elif msg[0] == "started":
                    self._started.append(msg[1])
                elif msg[0] == "store":
                    self._stores.append(msg[1])
                elif msg[0] == "exit":
                    self._exits[msg[1]] = msg[2]
                self._cond.notify_all()

    def wait_ready(self, timeout: float = ACCEPT_TIMEOUT_S) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: self.usable is not None, timeout):
                self.usable, self.why = False, f"not ready within {timeout:g} s"
            return bool(self.usable)

    def fork(self, fd: int) -> int | None:
        """A rank on ``fd`` (the zygote gets a copy): its OS pid, or None if the zygote cannot fork one."""
        with self._send_lock, self._cond:
            try:
                socket.send_fds(self.sock, [pickle.dumps(("start", os.getcwd()))], [fd])
            except OSError:
                return None
            self._cond.wait_for(lambda: self._started or self._gone or not self.usable)
            return self._started.pop(0) if self._started else None

    def store(self, host: str, timeout_s: float) -> int | None:
        """The port of a rendezvous store that a child of the zygote hosts for the run, or None."""
        with self._send_lock, self._cond:
            try:
                self.sock.send(pickle.dumps(("store", host, timeout_s)))
            except OSError:
                return None
            self._cond.wait_for(lambda: self._stores or self._gone or not self.usable)
            return self._stores.pop(0) if self._stores else None

    def exitcode(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            return -signal.SIGKILL if self._gone else None

    def join(self, pid: int, timeout: float | None) -> None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._gone, timeout)

    def kill(self, pid: int) -> None:
        try:
            with self._send_lock:
                self.sock.send(pickle.dumps(("kill", pid)))
        except OSError:
            pass

    def close(self) -> None:
        """The zygote ends (any rank still running with it); called once the run's ranks are done."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.popen is not None:
            try:  # it reads the end at once, unless it is still importing (a run that ended before a rank started)
                self.popen.wait(5 if self.usable else 0)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._reader.join(5)
        self.sock.close()


class _Forked:
    """A rank forked by a zygote, with the calls the cluster makes (as :class:`_Child`)."""

    started_as = "fork"

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid

    def is_alive(self) -> bool:
        return self.zygote.exitcode(self.pid) is None

    def join(self, timeout: float | None = None) -> None:
        self.zygote.join(self.pid, timeout)

    def kill(self) -> None:
        if self.is_alive():
            self.zygote.kill(self.pid)

    @property
    def exitcode(self) -> int | None:
        return self.zygote.exitcode(self.pid)


class LocalLauncher:
    """Rank processes on this host, on loopback: forked by a zygote (:mod:`real_backends.zygote`), or fresh
    interpreters, children of this process, where it cannot be used."""

    store_host = "127.0.0.1"
    loopback = True

    def __init__(self, ranks_per_host: int | None = None) -> None:
        # Ranks on every device are forked: the zygote makes no CUDA context (a GPU rank makes its own after the
        # fork), and on an H200 host forked ranks gave what fresh ones give (docs/real-backend.md).
        self.ranks_per_host = ranks_per_host
        self._zygotes: list[_Zygote] = []

    def open(self, scenario) -> None:
        peak = scenario.peak_ranks()
        if self.ranks_per_host is not None and peak > self.ranks_per_host:
            raise ScenarioError(
                f"the scenario runs up to {peak} ranks at once and --ranks-per-host is "
                f"{self.ranks_per_host}: run it under torchrun across hosts (docs/real-backend.md)"
            )
        from .zygote import wanted

        if wanted():  # started now, so that its imports overlap the run's own set-up
            self._zygotes.append(_Zygote(child_env()))

    def store_port(self, timeout_s: float) -> int | None:
        """The port of the run's rendezvous store where the zygote hosts it (its ranks' groups meet there), or None:
        the run then hosts the store itself."""
        zygote = self._zygote()
        return zygote.store(self.store_host, timeout_s) if zygote is not None else None

    def close(self) -> None:
        zygotes, self._zygotes = self._zygotes, []
        for z in zygotes:
            z.close()

    def _zygote(self) -> _Zygote | None:
        """The zygote for this process's environment now (the one it had at open(), unless it changed since)."""
        from .zygote import wanted

        if not wanted():
            return None
        env = child_env()
        found = next((z for z in self._zygotes if z.env == env), None)
        if found is None:
            found = _Zygote(env)
            self._zygotes.append(found)
        return found if found.wait_ready() else None

    def start(self, cfg) -> tuple[Connection, Any]:
        """A rank forked by the zygote or, where there is none, ``python -m real_backends.rank FD``: a fresh
        interpreter rather than multiprocessing's spawn, which re-imports the caller's main module (a script on
        stdin or in a notebook has none)."""
        mine, theirs = socket.socketpair()
        try:
            zygote = self._zygote()
            pid = zygote.fork(theirs.fileno()) if zygote is not None else None
            if zygote is not None and pid is not None:
                assert zygote.popen is not None  # a zygote that forked is running
                proc: Any = _Forked(zygote, pid)
                cfg = dataclasses.replace(cfg, parent=zygote.popen.pid)  # the rank dies with the zygote
            else:
                proc = _Child(
                    subprocess.Popen(
                        [sys.executable, "-m", "real_backends.rank", str(theirs.fileno())],
                        pass_fds=[theirs.fileno()],
                        cwd=os.getcwd(),
                        env=child_env(),
                    )
                )
        finally:
            theirs.close()
        conn = Connection(mine.detach())
        conn.send(cfg)
        return conn, proc


# -- torchrun ---------------------------------------------------------------------------------------------------
def under_torchrun() -> bool:
    return all(k in os.environ for k in TORCHRUN_ENV)


def processes_needed(scenario) -> int:
    """Rank processes a run starts in all: the first group, plus every rank a scale-up or an abort adds."""
    size, total = scenario.ranks, scenario.ranks
    for ev in scenario.timeline:
        if ev.kind in ("scale_up", "abort") and ev.to > size:
            total += ev.to - size
        if ev.kind in ("scale_up", "scale_down"):
            size = ev.to
    return total


SECRET_KEY = "epsim/slot-secret"
PORT_KEY = "epsim/engine-port"


def _listen_address() -> tuple[str, int]:
    """Where slot 0 listens: ``EPSIM_PORT`` if set, else a free port (0), published by ``_publish_port``."""
    return os.environ["MASTER_ADDR"], int(os.environ.get("EPSIM_PORT") or 0)


def _publish_port(port: int) -> None:
    _job_store().set(PORT_KEY, str(port))


def _engine_address() -> tuple[str, int]:
    """Where a slot connects: ``EPSIM_PORT`` if set, else the port slot 0 published (waiting for it)."""
    fixed = os.environ.get("EPSIM_PORT")
    port = int(fixed) if fixed else int(_job_store().get(PORT_KEY).decode())
    return os.environ["MASTER_ADDR"], port


def _job_store():
    """The job's own store (torchrun's, at MASTER_ADDR:MASTER_PORT): whoever can reach it is part of the job."""
    import datetime

    from torch.distributed import TCPStore

    return TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=ACCEPT_TIMEOUT_S),
    )


def _authkey(create: bool = False) -> bytes:
    """The key the slots' challenge uses: random, made by slot 0 and passed through the job's store (a key derived
    from public values such as the run id would let anyone who can connect pass the challenge)."""
    store = _job_store()
    if create:
        store.set(SECRET_KEY, os.urandom(32).hex())
    return bytes.fromhex(store.get(SECRET_KEY).decode())


class _Slot:
    """A torchrun slot serving a rank: alive until its connection closes."""

    started_as = "torchrun slot"

    def __init__(self, conn: Connection, info: dict[str, Any]) -> None:
        self.conn, self.info, self.pid = conn, info, info["os_pid"]
        self._gone = threading.Event()
        self.killed = False

    def on_eof(self) -> None:
        self._gone.set()

    def is_alive(self) -> bool:
        return not self._gone.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._gone.wait(timeout)

    def kill(self) -> None:
        if self.is_alive():
            self.killed = True
            try:
                self.conn.send(("kill",))
            except OSError:
                pass

    @property
    def exitcode(self) -> int | None:
        if self.is_alive():
            return None
        return -signal.SIGKILL if self.killed else 0


class TorchrunLauncher:
    """Slot 0's side: the engine runs here and hands ranks to the slots torchrun started."""

    loopback = False

    def __init__(self, ranks_per_host: int | None = None) -> None:
        self.store_host = os.environ["MASTER_ADDR"]
        self.world = int(os.environ["WORLD_SIZE"])
        self.ranks_per_host = ranks_per_host
        self._listener: socket.socket | None = None
        self._free: list[tuple[Connection, dict[str, Any]]] = []
        self._started: list[_Slot] = []
        self._own: subprocess.Popen | None = None

    def store_port(self, timeout_s: float) -> None:
        """Slot 0 hosts the run's store itself (the slots are not its children)."""
        return None

    def open(self, scenario) -> None:
        processes = processes_needed(scenario)
        if processes > self.world:
            raise ScenarioError(
                f"the scenario starts {processes} rank processes in all; torchrun started "
                f"{self.world} slots (--nproc-per-node x nodes); each slot serves one rank"
            )
        key = _authkey(create=True)
        try:
            self._listener = socket.create_server(_listen_address())
        except OSError as exc:
            host, port = _listen_address()
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            fix = "pick a free port or unset EPSIM_PORT" if port else "check MASTER_ADDR"
            raise ScenarioError(
                f"cannot listen for the torchrun slots on {host}:{port or 'a free port'} ({why}); {fix}"
            ) from None
        address = self._listener.getsockname()[:2]
        _publish_port(address[1])
        # Slot 0 is this process's job too: a child connects like every other slot.
        self._own = subprocess.Popen(
            [sys.executable, "-m", "real_backends.launch"], env=dict(child_env(), EPSIM_SLOT_OF="0")
        )
        # Each accepted slot goes into _free at once, so that close() tells it to end whatever happens next.
        deadline = time.monotonic() + ACCEPT_TIMEOUT_S
        while len(self._free) < self.world:
            self._listener.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock, _ = self._listener.accept()
            except (socket.timeout, OSError):
                raise ScenarioError(
                    f"only {len(self._free)} of {self.world} torchrun slots connected to "
                    f"{address[0]}:{address[1]} within {ACCEPT_TIMEOUT_S:g} s"
                ) from None
            sock.settimeout(None)
            wait_s = min(HELLO_TIMEOUT_S, max(0.1, deadline - time.monotonic()))
            _recv_timeout(sock, wait_s)  # a connection that never answers the challenge cannot hold the wait
            conn = Connection(sock.detach())
            try:  # the shared key's challenge before anything is unpickled from the network
                deliver_challenge(conn, key)
                answer_challenge(conn, key)
            except Exception:  # noqa: BLE001 - not one of ours: drop it and go on waiting
                conn.close()
                continue
            try:
                info = receive_hello(conn, wait_s)
            except ScenarioError:
                conn.close()
                raise
            if info is None:  # one of ours (it had the key), so the job cannot have all its slots
                conn.close()
                raise ScenarioError(
                    f"a torchrun slot connected and then died or did not place its clock within "
                    f"{wait_s:g} s ({len(self._free)} of {self.world} placed); see its output"
                )
            _recv_timeout(conn, None)
            self._free.append((conn, info))
        slots = self._free = sorted(self._free, key=lambda s: s[1]["rank"])
        share_clocks([info for _, info in slots])
        hosts = {info["host"] for _, info in slots}
        if self.ranks_per_host is not None and scenario.peak_ranks() > self.ranks_per_host * len(hosts):
            raise ScenarioError(
                f"the scenario runs up to {scenario.peak_ranks()} ranks at once; {len(hosts)} "
                f"host(s) at --ranks-per-host {self.ranks_per_host} take "
                f"{self.ranks_per_host * len(hosts)}"
            )

    def start(self, cfg) -> tuple[Connection, Any]:
        conn, info = self._free.pop(self._next_slot())
        cfg.parent = None  # the slot's parent is torchrun's agent, not this process
        if cfg.device.startswith("cuda"):
            cfg.device = f"cuda:{info['local_rank']}"
        conn.send(("config", cfg))
        slot = _Slot(conn, info)
        self._started.append(slot)
        return conn, slot

    def _next_slot(self) -> int:
        """The first waiting slot (by torchrun rank) on a host below ``ranks_per_host`` live ranks."""
        if self.ranks_per_host is None:
            return 0
        live: dict[str, int] = {}
        for slot in self._started:
            if slot.is_alive():
                live[slot.info["host"]] = live.get(slot.info["host"], 0) + 1
        for i, (_, info) in enumerate(self._free):
            if live.get(info["host"], 0) < self.ranks_per_host:
                return i
        raise ScenarioError(
            f"every host already runs {self.ranks_per_host} ranks (--ranks-per-host); start torchrun on more hosts"
        )

    def close(self) -> None:
        placed = {info["os_pid"] for _, info in self._free} | {slot.pid for slot in self._started}
        for conn, _ in self._free:
            try:
                conn.send(("done",))
                conn.close()
            except OSError:
                pass
        self._free = []
        if self._listener is not None:
            self._listener.close()
        if self._own is not None:
            # Slot 0's own slot ends once told so (or once its rank ends); one the wait never placed (it failed
            # first) would keep trying to connect to a closed listener until its own deadline.
            try:
                self._own.wait(30 if self._own.pid in placed else 0)
            except subprocess.TimeoutExpired:
                self._own.kill()
                self._own.wait()


def serve_slot() -> int:
    """A slot other than the engine's: connect, then run the rank it is given (or none), and exit."""
    from .rank import rank_main

    rank = int(os.environ.get("EPSIM_SLOT_OF") or os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    address = _engine_address()
    deadline = time.monotonic() + ACCEPT_TIMEOUT_S
    while True:  # slot 0 may not listen yet (with EPSIM_PORT; otherwise it published the port once listening)
        try:
            sock = socket.create_connection(address, timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    key = _authkey()
    answer_challenge(conn, key)
    deliver_challenge(conn, key)
    conn.send(
        {
            "rank": rank,
            "local_rank": local,
            "host": socket.gethostname(),
            "os_pid": os.getpid(),
            "clock_domain": clock_domain(),
        }
    )
    msg = answer_clock(conn)
    if msg is None or msg[0] != "config":
        return 0
    rank_main(conn, msg[1])
    return 0


if __name__ == "__main__":
    sys.exit(serve_slot())
