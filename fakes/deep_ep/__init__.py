"""A fake of DeepEP's v1 ``deep_ep.Buffer`` for the simulation (see :mod:`fakes.deep_ep.buffer`)."""

import contextlib
import sys

from ._nvshmem import NvshmemError, configure
from ._team import DeepEPTimeout
from .buffer import AVAILABLE, CONSTRUCTING, DESTROYED, DESTROYING, LEAKED, POISONED, Buffer, EventOverlap

__all__ = [
    "Buffer",
    "EventOverlap",
    "DeepEPTimeout",
    "NvshmemError",
    "configure",
    "installed",
    "CONSTRUCTING",
    "AVAILABLE",
    "DESTROYING",
    "DESTROYED",
    "LEAKED",
    "POISONED",
]


@contextlib.contextmanager
def installed():
    """Inside the block, ``import deep_ep`` (and ``from deep_ep import Buffer``) gives this fake."""
    module = sys.modules[__name__]
    saved = sys.modules.get("deep_ep")
    sys.modules["deep_ep"] = module
    try:
        yield module
    finally:
        if saved is None:
            sys.modules.pop("deep_ep", None)
        else:
            sys.modules["deep_ep"] = saved
