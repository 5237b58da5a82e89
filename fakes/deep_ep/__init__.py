"""A fake of DeepEP's v1 ``deep_ep.Buffer`` for the simulation (see :mod:`fakes.deep_ep.buffer`)."""

from ._nvshmem import NvshmemError, configure
from ._team import DeepEPTimeout
from .buffer import (AVAILABLE, CONSTRUCTING, DESTROYED, DESTROYING, LEAKED, POISONED, Buffer, EventOverlap)

__all__ = ["Buffer", "EventOverlap", "DeepEPTimeout", "NvshmemError", "configure", "CONSTRUCTING", "AVAILABLE",
           "DESTROYING", "DESTROYED", "LEAKED", "POISONED"]
