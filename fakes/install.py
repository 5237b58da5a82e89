"""Import shims: inside ``with fakes.installed():`` client code's ``import nixl._api`` gets the fake NIXL and
``import deep_ep`` the fake DeepEP.

Every package name that vLLM, SGLang and Ray import NIXL under is covered: ``nixl`` (the meta package),
``nixl_cu12``, ``nixl_cu13``, ``rixl`` (ROCm, older) and ``nixl_rocm`` (ROCm, newer).  Whatever those names meant
before the block (the real wheel, or nothing) is restored afterwards, so one test session can use both.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Iterator

from .nixl import _api, _bindings, _utils
from .nixl import logging as nixl_logging
from .nixl._fabric import FakeFabric, use_fabric

NIXL_PACKAGES = ("nixl", "nixl_cu12", "nixl_cu13", "rixl", "nixl_rocm")


def _package(name: str) -> dict[str, types.ModuleType]:
    pkg = types.ModuleType(name, f"epsim fake standing in for {name} (NIXL 1.5.1)")
    pkg.__path__ = []  # a package, so that `import name._api` resolves through sys.modules
    exports = (
        "DEFAULT_COMM_PORT",
        "nixl_agent",
        "nixl_agent_config",
        "nixl_backend_handle",
        "nixl_prepped_dlist_handle",
        "nixl_thread_sync_t",
        "nixl_xfer_handle",
    )
    vars(pkg).update(
        {export: getattr(_api, export) for export in exports},
        __epsim_fake__=True,
        _api=_api,
        _bindings=_bindings,
        _utils=_utils,
        logging=nixl_logging,
    )
    return {
        name: pkg,
        f"{name}._api": _api,
        f"{name}._bindings": _bindings,
        f"{name}._utils": _utils,
        f"{name}.logging": nixl_logging,
    }


@contextlib.contextmanager
def installed(fabric: FakeFabric | None = None) -> Iterator[FakeFabric | None]:
    """Make the fake NIXL importable under every real name, and the fake DeepEP as ``deep_ep``; with ``fabric``,
    new agents live in it."""
    from . import deep_ep  # imports torch: only when the fakes are installed, not when fakes is imported

    shims: dict[str, types.ModuleType] = {"deep_ep": deep_ep}
    for name in NIXL_PACKAGES:
        shims.update(_package(name))
    saved = {name: sys.modules.get(name) for name in shims}
    sys.modules.update(shims)
    try:
        if fabric is None:
            yield None
        else:
            with use_fabric(fabric):
                yield fabric
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def is_fake(module: types.ModuleType) -> bool:
    return module in (_api, _bindings, _utils, nixl_logging) or getattr(module, "__epsim_fake__", False)
