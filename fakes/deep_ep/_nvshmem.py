"""NVSHMEM as DeepEP sees it: one reference-counted world per (simulated) process.

Facts reproduced (reference: "Re-initialising NVSHMEM in one process"):

- every ``nvshmemx_init_attr`` increments the init count; bootstrap runs only the first time, so a second init while
  the world is alive ignores its size and unique id (the new Buffer joins the *old* world);
- finalize tears down only when the count reaches zero;
- unpatched (``stock``), finalize does not reset the bootstrapped state: a later init with another size or id
  silently reuses the old world (NVIDIA/nvshmem#68);
- ``elastic`` (vLLM's patch to NVSHMEM 3.2.5): finalize at zero resets everything, a later init bootstraps anew;
- ``mi355``: re-initialising after a finalize fails outright (reported for ROCm MI355 builds).

The intranode-only high-throughput path never comes here.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

PROFILES = ("stock", "elastic", "mi355")


class NvshmemError(RuntimeError):
    """What a failed NVSHMEM call surfaces as in DeepEP (a CUDA/NVSHMEM error raised from the C++ side)."""


@dataclass
class World:
    """One process's NVSHMEM state."""

    init_count: int = 0
    bootstrapped: bool = False
    nranks: int | None = None  # the size the world was bootstrapped with
    uid: object = None
    generation: int = 0  # bumped at every real bootstrap
    finalized_once: bool = False
    history: list[tuple[str, int | None, int]] = field(default_factory=list)  # (event, nranks asked, count after)

    def init(self, nranks: int, uid: object, profile: str) -> int:
        """``nvshmemx_init_attr``: the world size in effect afterwards (which may not be ``nranks``)."""
        if not self.bootstrapped:
            if self.finalized_once and profile == "mi355":
                raise NvshmemError(
                    "nvshmemx_init_attr: re-initialisation after finalize is not supported (mi355 profile)"
                )
            self.bootstrapped, self.nranks, self.uid = True, nranks, uid
            self.generation += 1
        self.init_count += 1
        self.history.append(("init", nranks, self.init_count))
        assert self.nranks is not None  # bootstrapped above, or before
        return self.nranks

    def finalize(self, profile: str) -> None:
        if self.init_count <= 0:
            raise NvshmemError("nvshmem_finalize called without a matching init")
        self.init_count -= 1
        self.history.append(("finalize", None, self.init_count))
        if self.init_count == 0:
            self.finalized_once = True
            if profile in ("elastic", "mi355"):  # torn down for real (the patch resets the bootstrapped state)
                self.bootstrapped, self.nranks, self.uid = False, None, None
            # stock: the bootstrapped state survives; the next init reuses the old world
            # mi355: the next init fails (init checks finalized_once)


class Worlds:
    """Every simulated process's NVSHMEM world, and the profile they follow."""

    def __init__(self, profile: str = "stock") -> None:
        if profile not in PROFILES:
            raise ValueError(f"NVSHMEM profile {profile!r} not known; use one of {', '.join(PROFILES)}")
        self.profile = profile
        self._by_pid: dict[int, World] = {}

    def of(self, pid: int) -> World:
        world = self._by_pid.get(pid)
        if world is None:
            world = self._by_pid[pid] = World()
        return world


_PER_KERNEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def worlds(kernel) -> Worlds:
    """The NVSHMEM worlds of one simulation (default profile ``stock``)."""
    found = _PER_KERNEL.get(kernel)
    if found is None:
        found = _PER_KERNEL[kernel] = Worlds()
    return found


def configure(kernel, profile: str) -> Worlds:
    """Choose the NVSHMEM profile of a simulation before its first Buffer: ``stock``, ``elastic`` or ``mi355``."""
    found = _PER_KERNEL[kernel] = Worlds(profile)
    return found
