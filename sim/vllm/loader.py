"""A fresh instance of vLLM's EPLB modules for one process: vLLM's own files from a :class:`~.source.VllmSource`,
the stand-ins of :mod:`.standins` where vLLM's module cannot be imported here.

While loading, ``sys.modules`` holds none of ``vllm``'s modules and a finder first in ``sys.meta_path`` answers for
``vllm.*`` only: a stand-in, a stand-in package over the source folder, or the file from the chosen sources (never
an installed vLLM elsewhere on the path).  Afterwards the modules are taken out of ``sys.modules`` again: each
simulated process holds its own through the globals of its modules, so vLLM's module-level caches (``nixl_utils``
binds ``NixlWrapper`` on first use) belong to one process, and nothing of one run leaks into another.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from pathlib import Path
from typing import Any

from sim.compiled import CompiledOnce
from sim.eplb.communicators.plugins import isolated_package

from . import standins
from .source import VllmSource

_lock = threading.Lock()  # sys.meta_path and sys.modules are process-wide


class _StandinLoader(importlib.abc.Loader):
    def __init__(self, world: standins.World) -> None:
        self.world = world

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module: Any) -> None:  # a module being made: standins names what it gets
        build = standins.STANDINS.get(module.__name__)
        module.__epsim_standin__ = True
        if build is not None:
            build(module, self.world)


def _spec(fullname: str, path: Path, package: bool = False):
    # Each simulated process executes its own instance of vLLM's modules; compiling them is most of that cost.
    return importlib.util.spec_from_file_location(
        fullname,
        path,
        loader=CompiledOnce(fullname, str(path)),
        submodule_search_locations=[str(path.parent)] if package else None,
    )


class _VllmFinder(importlib.abc.MetaPathFinder):
    """Answers for ``vllm`` and its submodules from one source root."""

    def __init__(self, root: Path, world: standins.World) -> None:
        self.root, self.loader = root, _StandinLoader(world)

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        rel = Path(*fullname.split("."))
        if fullname in standins.PACKAGES:
            spec = importlib.machinery.ModuleSpec(fullname, self.loader, is_package=True)
            spec.submodule_search_locations = [str(self.root / rel)]
            return spec
        if fullname in standins.STANDINS:
            return importlib.machinery.ModuleSpec(fullname, self.loader)
        package = self.root / rel / "__init__.py"
        if package.is_file():
            return _spec(fullname, package, package=True)
        module = self.root / rel.with_suffix(".py")
        if module.is_file():
            return _spec(fullname, module)
        return None  # ModuleNotFoundError, as for any missing module


class VllmModules:
    """One process's instance of vLLM's modules (name -> module) and the world its stand-ins answer from."""

    def __init__(self, source: VllmSource, modules: dict[str, types.ModuleType], world: standins.World) -> None:
        self.source, self.modules, self.world = source, modules, world

    def __getitem__(self, name: str) -> Any:  # a module of vLLM's: its names are vLLM's, not known here
        return self.modules[name]


def load(source: VllmSource, *names: str) -> VllmModules:
    """Fresh instances of vLLM modules ``names`` (and whatever they import) from ``source``."""
    world = standins.World()
    finder = _VllmFinder(source.root, world)
    with _lock, isolated_package("vllm") as fresh:
        sys.meta_path.insert(0, finder)
        try:
            for name in names:
                importlib.import_module(name)
        finally:
            sys.meta_path.remove(finder)
    return VllmModules(source, fresh, world)
