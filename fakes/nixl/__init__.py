"""Fake NIXL 1.5.1: importable as ``nixl._api`` and ``nixl._bindings`` through :mod:`fakes.install`.

The names below are looked up on first use, so that importing one light module of the package (the fault
catalogue, ``fakes.nixl._faults``, which every command's argument checks read) does not import the agent."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the type checker sees: the same names, imported at once
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

_HOME = {
    **dict.fromkeys(
        (
            "DEFAULT_COMM_PORT",
            "nixl_agent",
            "nixl_agent_config",
            "nixl_backend_handle",
            "nixl_prepped_dlist_handle",
            "nixl_thread_sync_t",
            "nixl_xfer_handle",
        ),
        "._api",
    ),
    **dict.fromkeys(
        ("FakeFabric", "TimeModel", "current_fabric", "default_fabric", "reset_default_fabric", "use_fabric"),
        "._fabric",
    ),
    "SimulatedCrash": "._status",
    "PROFILES": ".profiles",
    "Profile": ".profiles",
}

__all__ = [
    "DEFAULT_COMM_PORT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
    "FakeFabric",
    "TimeModel",
    "current_fabric",
    "default_fabric",
    "reset_default_fabric",
    "use_fabric",
    "SimulatedCrash",
    "PROFILES",
    "Profile",
]
assert sorted(__all__) == sorted(_HOME)


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home, __name__), name)
