"""``nixl._utils``: the host-memory helpers NIXL's own tests and benchmarks use (a C extension in the wheel).

Observed on NIXL 1.5.1 (``fakes/conformance``, case ``utils_helpers``): ``malloc_passthru(n)`` returns the address of
``n`` bytes from the C allocator, ``free_passthru(addr)`` frees it, ``ba_buf(addr, n)`` fills ``n`` bytes with
``0xba``, and ``verify_transfer(a, b, n)`` returns None whether or not the two ranges hold the same bytes (its check
is a C ``assert``, compiled out of the wheel).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]

PATTERN = 0xBA


def _size(n: Any, what: str) -> int:
    value = int(n)  # (pybind11 takes any int-like; a negative size wraps in C, which no caller means)
    if value < 0:
        raise TypeError(f"{what}: a size must not be negative, got {value}")
    return value


def malloc_passthru(size: int) -> int:
    """``size`` bytes from the C allocator: their address."""
    return int(_libc.malloc(_size(size, "malloc_passthru")) or 0)


def free_passthru(addr: int) -> None:
    _libc.free(int(addr))


def ba_buf(addr: int, size: int) -> None:
    """Fill ``size`` bytes at ``addr`` with 0xba."""
    ctypes.memset(int(addr), PATTERN, _size(size, "ba_buf"))


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """Compare ``size`` bytes at the two addresses and return None either way, as the wheel's build does."""
    n = _size(size, "verify_transfer")
    ctypes.string_at(int(addr1), n) == ctypes.string_at(int(addr2), n)  # noqa: B015 - read, as the C code reads
    return None
