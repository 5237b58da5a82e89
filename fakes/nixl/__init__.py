"""Fake NIXL 1.5.1: importable as ``nixl._api`` and ``nixl._bindings`` through :mod:`fakes.install`."""

from ._api import (
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)
from ._fabric import FakeFabric, TimeModel, current_fabric, default_fabric, reset_default_fabric, use_fabric
from ._status import SimulatedCrash
from .profiles import PROFILES, Profile

__all__ = [
    "DEFAULT_COMM_PORT", "nixl_agent", "nixl_agent_config", "nixl_backend_handle", "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t", "nixl_xfer_handle", "FakeFabric", "TimeModel", "current_fabric", "default_fabric",
    "reset_default_fabric", "use_fabric", "SimulatedCrash", "PROFILES", "Profile",
]
