"""Rank processes forked from an interpreter that has imported torch and NIXL once per run (a zygote).

A fresh ``python -m real_backends.rank`` spends seconds of CPU importing torch before it does anything (3.5 s on a
2-core machine, where the test suite starts over sixty ranks); a rank that a scale-up adds keeps the group waiting
that long.  The local launcher instead starts this process when a run opens: it imports what a rank imports, then
forks one child per rank.  The child runs the same code from the same modules as a fresh rank would, in a process
of its own, and ends through the interpreter's normal exit (finalizers and ``atexit`` run, as in a fresh rank).

Fork safety: the zygote forks only while it has one thread (checked before every fork; torch's import starts none
with ``OMP_NUM_THREADS=1``, which the real cluster sets for its ranks), and it has made no NIXL agent, CUDA context
or process group: those are made by the child, after the fork.  A zygote that cannot be used says so and the
launcher starts fresh interpreters instead; ``EPSIM_RANK_ZYGOTE=0`` asks for those from the start.

Protocol, on a ``SOCK_SEQPACKET`` socket pair (one pickled message per packet): the launcher sends
``("start", cwd)`` with the rank's end of its socket pair attached (``SCM_RIGHTS``); the zygote answers
``("started", os_pid)``, and ``("exit", os_pid, code)`` once it has reaped a child (``code`` as
``Popen.returncode``: ``-N`` for signal N); ``("kill", os_pid)`` SIGKILLs a child it has not reaped yet (it is the
child's parent, so the pid cannot belong to another process before that).  The zygote first says ``("ready",)``, or
``("unusable", why)`` and exits.  ``("store", host, timeout_s)`` forks a child that hosts the run's rendezvous
store; the zygote answers ``("store", port, os_pid)`` (``port`` None if it could not listen).  It dies with the
run's process and every rank with it (``PR_SET_PDEATHSIG``), so a killed run leaves nothing behind; a ^C reaches
the run, which stops its ranks itself.
"""

from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import socket
import sys
import threading
from typing import NoReturn

from .rank import _die_with_parent

ENV = "EPSIM_RANK_ZYGOTE"
# What a rank imports before it can start (the rest is small): imported here once, in this order.
PRELOAD = (
    "torch",
    "torch.distributed",
    "numpy",
    "real_backends.rank",
    "real_backends.ledger",
    "real_backends.groups",
    "real_backends.nixl_real",
    "sim.eplb.move",
    "sim.eplb.communicators.per_agent",
    "sim.eplb.communicators.shared_agent",
    "sim.eplb.communicators.arena_registry",
)
MAX_PACKET = 1 << 16


def wanted() -> bool:
    """Whether rank processes come from a zygote: on Linux, unless ``EPSIM_RANK_ZYGOTE=0``."""
    return sys.platform.startswith("linux") and os.environ.get(ENV, "1").strip() != "0"


def _tell(ctrl: socket.socket, msg: tuple) -> bool:
    """Send the run ``msg``; False if it is gone (it closed its end: nothing left to tell)."""
    try:
        ctrl.send(pickle.dumps(msg))
        return True
    except OSError:
        return False


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _preload() -> str | None:
    """Import what a rank imports; the reason the zygote cannot be used, or None."""
    try:
        from .nixl_real import import_real_nixl

        for name in PRELOAD:
            importlib.import_module(name)
        import_real_nixl()
    except Exception as exc:  # noqa: BLE001 - a fresh rank then meets the same error and reports it
        return f"importing what a rank needs failed: {type(exc).__name__}: {exc}"
    threads = _threads()
    if threads != 1:
        return f"{threads} threads after the imports (forking is safe with one)"
    return None


def serve(ctrl: socket.socket) -> tuple[int, str] | None:
    """The zygote's loop.  Returns only in a forked child: (the rank's socket fd, the working directory it
    starts in); None when the run closed the socket."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a reaped child wakes the select through wake_r
    children: set[int] = set()
    while True:
        try:
            ready, _, _ = select.select([ctrl, wake_r], [], [])  # type: ignore[type-var]  # a socket and an fd
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                if not _tell(ctrl, ("exit", pid, os.waitstatus_to_exitcode(status))):
                    return None
        if ctrl not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(ctrl, MAX_PACKET, 1)
        except OSError:
            data, fds = b"", []
        if not data:
            return None  # the run is over (or gone): the zygote ends, and with it any rank still running
        msg = pickle.loads(data)
        if msg[0] == "kill":
            if msg[1] in children:
                os.kill(msg[1], signal.SIGKILL)
            continue
        store = msg[0] == "store"
        threads = _threads()
        if threads != 1:  # never fork with a second thread, whose locks the child would inherit held; the
            for fd in fds:  # ranks already forked go on (an exit would take them with it)
                os.close(fd)
            if not _tell(ctrl, ("unusable", f"{threads} threads at a fork")):
                return None
            continue
        me = os.getpid()
        port_r, port_w = os.pipe() if store else (-1, -1)
        pid = os.fork()
        if pid == 0:
            _die_with_parent(me)  # from the first instant: a zygote that dies takes every rank with it
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            ctrl.close()
            if store:
                os.close(port_r)
                _host_store(msg[1], msg[2], port_w)  # never returns
            signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has it
            os.chdir(msg[1])
            return fds[0], msg[1]
        for fd in fds:
            os.close(fd)
        children.add(pid)
        if store:
            os.close(port_w)
            with os.fdopen(port_r) as answer:
                port = answer.read().strip()  # empty: it could not listen, and exits (reported as any child's)
            if not _tell(ctrl, ("store", int(port) if port else None, pid)):
                return None
        elif not _tell(ctrl, ("started", pid)):
            return None


def _host_store(host: str, timeout_s: float, port_w: int) -> NoReturn:
    """A forked child that serves the run's rendezvous store (torch's TCPStore) until the zygote ends: the ranks
    open their gloo groups through it.  Here rather than in the run's own process, which would otherwise import
    torch for nothing else (2.5 s of CPU per run on a 2-core machine); the store's server thread is this child's,
    so the zygote still forks with one thread."""
    import datetime

    from torch.distributed import TCPStore

    try:
        server = TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        os.write(port_w, str(server.port).encode())
    except Exception as exc:  # noqa: BLE001 - the run hosts the store itself, and meets the error there
        print(f"epsim zygote: cannot host the store: {exc}", file=sys.stderr)
        os._exit(1)
    finally:
        os.close(port_w)
    while True:
        signal.pause()


def main(ctrl_fd: int, parent: int) -> None:
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C goes to the run, which stops every rank itself
    ctrl = socket.socket(fileno=ctrl_fd)
    why = _preload()
    if why is not None:
        _tell(ctrl, ("unusable", why))
        return
    if not _tell(ctrl, ("ready",)):
        return
    job = serve(ctrl)
    if job is None:
        return
    # The child: what `python -m real_backends.rank FD` does, with everything already imported.
    from multiprocessing.connection import Connection

    from .rank import rank_main

    conn = Connection(job[0])
    rank_main(conn, conn.recv())


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
