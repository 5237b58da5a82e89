"""What a catalogue case needs from an implementation, and the fake's implementation of it.

A case never imports NIXL itself: it asks the backend for agents, buffers, descriptor tuples typed with the run's
memory kind, a way to wait for asynchronous effects, and peers in other processes.  ``real_backends.nixl_real``
implements the same surface on the real library.
"""

from __future__ import annotations

import gc
import mmap
import ctypes
from typing import Any, Callable

PATTERN = 7  # the byte pattern a peer's buffer is filled with


class Backend:
    name = "abstract"
    api: Any
    bindings: Any
    utils: Any  # nixl._utils: the host-memory helpers of NIXL's own tests
    nixl_logging: Any  # nixl.logging
    memory = "DRAM"  # or "VRAM"

    # -- memory ---------------------------------------------------------------------------------------------
    def buf(self, nbytes: int, fill: int = 0):
        import torch

        return torch.full((nbytes,), fill, dtype=torch.uint8, device=self.device)

    device = "cpu"

    def dev(self, t) -> int:
        return max(t.get_device(), 0)

    def rd(self, t, offset: int = 0, length: int | None = None) -> list[tuple]:
        n = t.numel() - offset if length is None else length
        return [(t.data_ptr() + offset, n, self.dev(t), "")]

    def xd(self, t, offset: int = 0, length: int | None = None) -> list[tuple]:
        return [d[:3] for d in self.rd(t, offset, length)]

    def reg(self, agent, t, **kw):
        return agent.register_memory(self.rd(t, **kw), self.memory)

    def descs(self, agent, t, **kw):
        return agent.get_xfer_descs(self.xd(t, **kw), self.memory)

    def same(self, a, b) -> bool:
        return bool((a.cpu() == b.cpu()).all())

    def mmap(self, nbytes: int) -> "Mapped":
        return Mapped(nbytes, self)

    def unmapped(self, addr: int, nbytes: int) -> None:
        """Hook: memory at addr was unmapped (the fake tells its fabric; the real library finds out itself)."""

    # -- world ----------------------------------------------------------------------------------------------
    def agent(self, name: str | bytes | None, **conf: Any):  # not a str: to see the library's answer
        if conf:
            return self.api.nixl_agent(name, self.api.nixl_agent_config(**conf))
        return self.api.nixl_agent(name)

    def collect(self) -> None:
        gc.collect()

    def wait(self, pred: Callable[[], Any], tries: int = 200) -> Any:
        """Poll ``pred`` until it is truthy; the fake's polls are its progress, the real one sleeps between."""
        value = pred()
        for _ in range(tries):
            if value:
                return value
            self.pause()
            value = pred()
        return value

    def pause(self) -> None:
        pass

    def peer(self, name: str, nbytes: int = 4096) -> "Peer":
        raise NotImplementedError

    def close(self) -> None:
        pass


class Mapped:
    """An anonymous mapping the test can unmap while NIXL still knows it (``munmap`` under a registration)."""

    def __init__(self, nbytes: int, backend: Backend) -> None:
        self._map = mmap.mmap(-1, nbytes)
        self._map.write(bytes([PATTERN]) * nbytes)
        self.nbytes = nbytes
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._backend = backend

    def rd(self) -> list[tuple]:
        return [(self.addr, self.nbytes, 0, "")]

    def xd(self) -> list[tuple]:
        return [(self.addr, self.nbytes, 0)]

    def unmap(self) -> None:
        libc = ctypes.CDLL(None)
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        # mmap.close() refuses while a buffer is exported, and we want the pages gone under NIXL's feet.
        libc.munmap(ctypes.c_void_p(self.addr), ctypes.c_size_t(self.nbytes))
        self._backend.unmapped(self.addr, self.nbytes)


class Peer:
    """An agent in another process: its metadata, its buffer, and commands it runs there."""

    name: str
    md: bytes
    addr: int
    nbytes: int

    def call(self, cmd: str, *args: Any) -> Any:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def peer_command(api: Any, agent: Any, buf_addr: int, nbytes: int, cmd: str, args: tuple) -> Any:
    """What a peer does for each command; shared by the fake's simulated process and the real child process."""
    from .catalogue import observe

    if cmd == "md":
        return agent.get_agent_metadata()
    if cmd == "add":
        return observe(lambda: agent.add_remote_agent(args[0]))
    if cmd == "read":  # READ the remote buffer into ours; the list of states seen
        remote, raddr = args

        def go() -> list:
            local = agent.get_xfer_descs([(buf_addr, nbytes, 0)], "DRAM")
            rem = agent.get_xfer_descs([(raddr, nbytes, 0)], "DRAM")
            h = agent.initialize_xfer("READ", local, rem, remote)
            states = [agent.transfer(h)]
            while states[-1] == "PROC" and len(states) < 100000:
                states.append(agent.check_xfer_state(h))
            return states[-1]

        return observe(go)
    if cmd == "notif":
        return observe(lambda: agent.send_notif(args[0], args[1]))
    if cmd == "notifs":
        return agent.get_new_notifs()
    if cmd == "first_byte":
        return ctypes.c_uint8.from_address(buf_addr).value
    raise ValueError(f"unknown peer command {cmd!r}")


class FakeBackend(Backend):
    """The fake NIXL in a fabric of its own, with simulated processes standing in for OS processes."""

    name = "fake"

    def __init__(self, profile: str = "dram", memory: str = "DRAM", transport: str = "cma") -> None:
        from fakes.nixl import _api, _bindings, _utils
        from fakes.nixl import logging as nixl_logging
        from fakes.nixl._fabric import FakeFabric, use_fabric

        self.api, self.bindings = _api, _bindings
        self.utils, self.nixl_logging = _utils, nixl_logging
        self.profile = profile
        self.memory = memory
        self.fabric = FakeFabric(profile, transport=transport)
        self._scope = use_fabric(self.fabric)
        self._scope.__enter__()

    def unmapped(self, addr: int, nbytes: int) -> None:
        self.fabric.free(addr, nbytes)

    def peer(self, name: str, nbytes: int = 4096) -> Peer:
        return _FakePeer(self, name, nbytes)

    def close(self) -> None:
        self._scope.__exit__(None, None, None)


class _FakePeer(Peer):
    def __init__(self, backend: FakeBackend, name: str, nbytes: int) -> None:
        self.backend, self.name, self.nbytes = backend, name, nbytes
        fabric = backend.fabric
        self.pid = fabric.spawn_process(name)
        with fabric.process(self.pid):
            self._buf = (ctypes.c_uint8 * nbytes)()
            self.addr = ctypes.addressof(self._buf)
            ctypes.memset(self.addr, PATTERN, nbytes)
            self._agent = backend.api.nixl_agent(name)
            self._agent.register_memory([(self.addr, nbytes, 0, "")], "DRAM")
            self.md = self._agent.get_agent_metadata()

    def call(self, cmd: str, *args: Any) -> Any:
        if not self.backend.fabric.alive(self.pid):
            raise RuntimeError(f"peer {self.name} is dead")
        with self.backend.fabric.process(self.pid):
            return peer_command(self.backend.api, self._agent, self.addr, self.nbytes, cmd, args)

    def kill(self) -> None:
        # SIGKILL: the OS frees the process's memory; its agent vanishes without telling anyone.
        self.backend.fabric.kill_process(self.pid)
        self.backend.fabric.free(self.addr, self.nbytes)
