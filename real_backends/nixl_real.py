"""The real NIXL: finding it, the catalogue's backend surface on it (with peers in real child processes), and the
progress-thread setting rank processes may give it."""

from __future__ import annotations

import ctypes
import importlib
import multiprocessing as mp
import os
import time
from typing import Any

from fakes.conformance.backend import PATTERN, Backend, Peer, peer_command

# Where the real library lives, in the order we try: the meta package maps nixl._api to whichever variant is
# installed; the variants can also be imported directly.
NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13", "nixl_rocm", "rixl")
# The same, variants first: for a process that only checks that a real NIXL imports.  The meta package picks its
# variant by the CUDA version torch was built with, and on a CPU build of torch it learns that by importing torch
# (2.5 s of CPU on a 2-core machine), which a run's parent process does not otherwise need.
VARIANTS_FIRST = NIXL_MODULES[1:] + NIXL_MODULES[:1]


# nixl._api builds every agent's config with pthrDelay = 0: its progress thread polls the UCX workers without a
# timeout, a busy loop that keeps a core spinning per agent for as long as the agent lives (measured on 1.5.1: a
# second of CPU per second, four fifths of it in the kernel).  A host with a core per rank does not notice; on a
# 2-core machine three or four idle ranks take the cores from the ranks doing work.  A rank process started with this
# variable set gives its agents that poll timeout instead (NIXL's own knob; the C++ API exposes it, the Python one
# does not; NIXL's UCX progress thread rounds it up to whole milliseconds).  Unset or 0 is what vLLM runs.  The test
# suite sets 1000 on machines with fewer than 8 cores (tests/conftest.py; docs/real-backend.md says why).  Each rank
# reads its own environment (under torchrun, a slot on another host follows that host's), and reports the value it
# used in a ``nixl.config`` event: a real run's result lists them as ``metrics.nixl_progress_delay_us``.
PROGRESS_DELAY_ENV = "EPSIM_NIXL_PROGRESS_DELAY_US"


class NixlUnavailable(RuntimeError):
    pass


def progress_delay_us() -> int:
    """The progress threads' poll timeout asked for in :data:`PROGRESS_DELAY_ENV` (0: nixl._api's busy loop)."""
    from sim.errors import ScenarioError

    raw = os.environ.get(PROGRESS_DELAY_ENV, "").strip()
    try:
        value = int(raw or 0)
    except ValueError:
        value = -1
    if not 0 <= value <= 1_000_000:
        raise ScenarioError(
            f"{PROGRESS_DELAY_ENV}={raw!r}: give whole microseconds from 0 (nixl._api's own busy loop) to 1000000"
        )
    return value


def apply_progress_delay(bindings: Any) -> int:
    """Make agents this process creates from now on poll with :func:`progress_delay_us` (when it is not 0) instead of
    spinning; the delay in effect is returned.  Only the config nixl._api hands the bindings changes: every call the
    agent answers is the library's own."""
    delay = progress_delay_us()
    make = getattr(bindings.nixlAgent, "__wrapped__", bindings.nixlAgent)  # the library's own, wrapped or not
    if not delay:
        bindings.nixlAgent = make
        return 0

    def nixlAgent(name: str, config: Any) -> Any:  # noqa: N802 - the name nixl._api calls
        if config.pthrDelay == 0:
            config.pthrDelay = delay
        return make(name, config)

    nixlAgent.__wrapped__ = make  # type: ignore[attr-defined]  # what it stands in front of
    bindings.nixlAgent = nixlAgent
    return delay


def import_real_nixl(order: tuple[str, ...] = NIXL_MODULES) -> tuple[Any, Any, str]:
    """(``_api``, ``_bindings``, package name) of the real NIXL, or NixlUnavailable naming what was tried (in
    ``order``)."""
    errors = []
    for name in order:
        try:
            api = importlib.import_module(f"{name}._api")
            bindings = importlib.import_module(f"{name}._bindings")
        except Exception as exc:  # noqa: BLE001 - any import failure means "not this one"
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if getattr(importlib.import_module(name), "__epsim_fake__", False):
            continue
        return api, bindings, name
    raise NixlUnavailable("real NIXL cannot be imported (pip install 'epsim[real]'); tried " + "; ".join(errors))


def require_real(device: str) -> None:
    """What every real-backend command needs first, as one-line errors: a known device, the real NIXL, and a GPU
    for ``cuda``."""
    from sim.errors import BackendUnavailable, ScenarioError

    if device not in ("cpu", "cuda"):
        raise ScenarioError(f"--device {device!r}: use cpu or cuda")
    try:
        import_real_nixl(VARIANTS_FIRST)
    except NixlUnavailable as exc:
        raise BackendUnavailable(str(exc)) from None
    progress_delay_us()  # a bad value is one line here, not a crash in every rank
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BackendUnavailable("--device cuda needs a CUDA GPU; none is visible here")


class RealBackend(Backend):
    name = "real"

    def __init__(self, memory: str = "DRAM") -> None:
        self.api, self.bindings, self.package = import_real_nixl()
        self.utils = importlib.import_module(f"{self.package}._utils")
        self.nixl_logging = importlib.import_module(f"{self.package}.logging")
        self.memory = memory
        if memory == "VRAM":
            import torch

            if not torch.cuda.is_available():
                raise NixlUnavailable("--memory vram needs a CUDA GPU; none is visible")
            self.device = "cuda"

    def pause(self) -> None:
        time.sleep(0.005)

    def collect(self) -> None:
        super().collect()
        time.sleep(0.05)  # the C++ destructor joins the progress thread after the Python object goes

    def peer(self, name: str, nbytes: int = 4096) -> Peer:
        return _ChildPeer(self.package, name, nbytes)


def _peer_main(package: str, name: str, nbytes: int, conn) -> None:
    api = importlib.import_module(f"{package}._api")
    buf = (ctypes.c_uint8 * nbytes)()
    addr = ctypes.addressof(buf)
    ctypes.memset(addr, PATTERN, nbytes)
    agent = api.nixl_agent(name)
    agent.register_memory([(addr, nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), addr))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        cmd, args = msg
        try:
            conn.send(("ok", peer_command(api, agent, addr, nbytes, cmd, args)))
        except Exception as exc:  # noqa: BLE001 - report, the parent decides
            conn.send(("err", f"{type(exc).__name__}: {exc}"))


class _ChildPeer(Peer):
    def __init__(self, package: str, name: str, nbytes: int) -> None:
        ctx = mp.get_context("spawn")
        self.name, self.nbytes = name, nbytes
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_peer_main, args=(package, name, nbytes, child), daemon=True)
        self._proc.start()
        if not self._conn.poll(60):
            self.kill()
            raise RuntimeError(f"peer process {name} did not start within 60 s")
        self.md, self.addr = self._conn.recv()

    def call(self, cmd: str, *args: Any) -> Any:
        self._conn.send((cmd, args))
        if not self._conn.poll(30):
            raise RuntimeError(f"peer {self.name} did not answer {cmd!r} within 30 s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer {self.name}: {value}")
        return value

    def kill(self) -> None:
        self._proc.kill()
        self._proc.join(10)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self.kill()
