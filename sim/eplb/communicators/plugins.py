"""Finding strategies: built-in names or ``package.module:factory``, one fresh module instance per process."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import os
import sys
from typing import Callable

from sim.errors import UnknownStrategy

BUILTIN = {
    "per-communicator-agent": "sim.eplb.communicators.per_agent:create",
    "arena-registry": "sim.eplb.communicators.arena_registry:create",
    "shared-agent": "sim.eplb.communicators.shared_agent:create",
}

_instances = itertools.count()
FRESH_MARK = "#epsim"  # in the sys.modules names of per-process module instances


def forget_instances(keep: set[str]) -> int:
    """Drop from ``sys.modules`` the per-process module instances not in ``keep`` (a run's own, once it ended):
    a sweep of thousands of EP64 runs would otherwise keep 64-80 copies of a strategy's module per run."""
    gone = [name for name in sys.modules if FRESH_MARK in name and name not in keep]
    for name in gone:
        del sys.modules[name]
    return len(gone)


def resolve(name: str) -> str:
    """``module:factory`` for a built-in name or a user's path; UnknownStrategy (one line) otherwise."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" in name:
        module, _, factory = name.partition(":")
        if module and factory:
            return name
    raise UnknownStrategy(f"strategy {name!r} not found; known: {', '.join(BUILTIN)}, or package.module:factory")


def load(name: str, fresh: bool = True) -> Callable:
    """The factory of strategy ``name``.  With ``fresh``, from a new instance of its module, so that module-level
    state (a process-wide registry) belongs to one simulated process only."""
    module_name, _, factory_name = resolve(name).partition(":")
    if name not in BUILTIN and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # a user's module in the working directory, as `python -m` would find it
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise UnknownStrategy(f"strategy {name!r}: module {module_name!r} cannot be imported ({exc})") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - its parent package failed while importing
        raise UnknownStrategy(f"strategy {name!r}: importing the package of {module_name!r} failed: "
                              f"{type(exc).__name__}: {exc}") from None
    if spec is None or spec.loader is None:
        raise UnknownStrategy(f"strategy {name!r}: module {module_name!r} not found (is it on PYTHONPATH?)")
    if fresh:
        if spec.origin is None or not spec.has_location:
            raise UnknownStrategy(f"strategy {name!r}: module {module_name!r} has no source file to load afresh")
        unique = f"{module_name}{FRESH_MARK}{next(_instances)}"
        package = spec.submodule_search_locations  # not None: the factory lives in a package's __init__
        spec = importlib.util.spec_from_file_location(unique, spec.origin, submodule_search_locations=package)
        module = importlib.util.module_from_spec(spec)
        # Relative imports resolve in the real package: the module's parent, or the package itself for an __init__.
        module.__package__ = module_name if package is not None else module_name.rpartition(".")[0]
        sys.modules[unique] = module  # dataclasses and pickling look classes' modules up here
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a user's module failing to import (or calling
            # sys.exit while it imports) is their error, in one line
            raise UnknownStrategy(f"strategy {name!r}: importing {module_name!r} failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
    else:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise UnknownStrategy(f"strategy {name!r}: {module_name!r} has no callable {factory_name!r}")
    home = getattr(factory, "__module__", None)
    if fresh and isinstance(home, str) and FRESH_MARK not in home and home != module_name:
        # Re-exported (``from .impl import create`` in a package's __init__): the module that defines it holds its
        # module-level state (a process-wide agent registry), so that is the one each process needs afresh.
        try:
            return load(f"{home}:{factory.__name__}", fresh=True)
        except UnknownStrategy:
            pass  # defined where no source can be loaded afresh (an extension module): use it as found
    _check_signature(name, factory)
    return factory


def _check_signature(name: str, factory: Callable) -> None:
    """Workers call ``factory(group, expert_weights, expert_buffer, prev_communicator)``, positionally, as vLLM
    does; a factory that cannot take that is a bad ``--strategy``, said before the run rather than as a crash of
    every rank inside it."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (a builtin or an extension type): let the call decide
        return
    try:
        signature.bind(None, None, None, None)
    except TypeError as exc:
        raise UnknownStrategy(f"strategy {name!r}: the factory must take (group, expert_weights, expert_buffer, "
                              f"prev_communicator) positionally; {getattr(factory, '__name__', 'it')}{signature} "
                              f"cannot ({exc})") from None
