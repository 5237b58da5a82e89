"""Fakes of the libraries epsim's code under test talks to, importable in their place (see :mod:`fakes.install`)."""

from .install import installed

__all__ = ["installed"]
