"""Fakes of the libraries epsim's code under test talks to, importable in their place (see :mod:`fakes.install`).

``installed`` is looked up on first use: importing one light module of the fakes (the fault catalogue's
``fakes.nixl._faults``, which every command's argument checks read) does not import the whole fake NIXL."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .install import installed

__all__ = ["installed"]


def __getattr__(name: str) -> Any:
    if name == "installed":
        from .install import installed

        return installed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
