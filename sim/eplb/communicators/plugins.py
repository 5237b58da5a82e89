"""Finding strategies: built-in names or ``package.module:factory``, one fresh module instance per process."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import itertools
import os
import sys
from typing import Any, Callable, Iterator

from sim.compiled import CompiledOnce
from sim.errors import UnknownStrategy

BUILTIN = {
    "per-communicator-agent": "sim.eplb.communicators.per_agent:create",
    "per-communicator-agent-deferred": "sim.eplb.communicators.per_agent:create_deferred",
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
    raise UnknownStrategy(
        f"strategy {name!r} not found; known: {', '.join(BUILTIN)}, vllm[:PATH], "
        "vllm+shared-agent[:PATH], or package.module:factory"
    )


# epsim's own packages: a built-in's module is loaded afresh on its own; the package around it holds no per-process
# state and is far too big to import again for every simulated process.
EPSIM_PACKAGES = frozenset({"sim", "fakes", "real_backends", "benchmarks"})


def load(name: str, fresh: bool = True) -> Callable:
    """The factory of strategy ``name``.  With ``fresh``, from a new instance of its module (a built-in) or of its
    whole top-level package (anything else), so that module-level state (a process-wide registry) belongs to one
    simulated process only, and every module of a user's package binds the libraries the caller has installed now
    (the fakes, in a simulated process) rather than whatever was importable when the package was first imported."""
    from sim.vllm import strategy_name

    if strategy_name.is_vllm(name):
        return _check_signature(name, strategy_name.load(name, fresh))
    module_name, _, factory_name = resolve(name).partition(":")
    if name not in BUILTIN and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # a user's module in the working directory, as `python -m` would find it
    root = module_name.partition(".")[0]
    if fresh and root not in EPSIM_PACKAGES:
        module = fresh_package_module(name, module_name)
        home = None
    else:
        module = _fresh_file(name, module_name) if fresh else _imported(name, module_name)
        home = getattr(getattr(module, factory_name, None), "__module__", None)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise UnknownStrategy(f"strategy {name!r}: {module_name!r} has no callable {factory_name!r}")
    if fresh and isinstance(home, str) and FRESH_MARK not in home and home != module_name:
        # Re-exported (``from .impl import create`` in a package's __init__): the module that defines it holds its
        # module-level state (a process-wide agent registry), so that is the one each process needs afresh.
        try:
            return load(f"{home}:{factory.__name__}", fresh=True)
        except UnknownStrategy:
            pass  # defined where no source can be loaded afresh (an extension module): use it as found
    return _check_signature(name, factory)


def _find_spec(name: str, module_name: str):
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise UnknownStrategy(f"strategy {name!r}: module {module_name!r} cannot be imported ({exc})") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - its parent package failed while importing
        raise UnknownStrategy(
            f"strategy {name!r}: importing the package of {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    if spec is None or spec.loader is None:
        raise UnknownStrategy(f"strategy {name!r}: module {module_name!r} not found (is it on PYTHONPATH?)")
    return spec


def _imported(name: str, module_name: str):
    _find_spec(name, module_name)
    return sys.modules.get(module_name) or importlib.import_module(module_name)


def _fresh_file(name: str, module_name: str):
    """A new instance of one module, registered under a unique name; its imports resolve as usual."""
    spec = _find_spec(name, module_name)
    if spec.origin is None or not spec.has_location:
        raise UnknownStrategy(f"strategy {name!r}: module {module_name!r} has no source file to load afresh")
    unique = f"{module_name}{FRESH_MARK}{next(_instances)}"
    package = spec.submodule_search_locations  # not None: the factory lives in a package's __init__
    # A source file is compiled once per process (each instance still runs its body); any other file (a .pyc
    # alone, an extension module) takes the loader its suffix asks for.
    loader = CompiledOnce(unique, spec.origin) if spec.origin.endswith(".py") else None
    fresh = importlib.util.spec_from_file_location(
        unique, spec.origin, submodule_search_locations=package, loader=loader
    )
    assert fresh is not None and fresh.loader is not None  # a source file's spec, as checked above
    module = importlib.util.module_from_spec(fresh)
    # Relative imports resolve in the real package: the module's parent, or the package itself for an __init__.
    module.__package__ = module_name if package is not None else module_name.rpartition(".")[0]
    sys.modules[unique] = module  # dataclasses and pickling look classes' modules up here
    try:
        fresh.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a user's module failing to import (or calling
        # sys.exit while it imports) is their error, in one line
        raise UnknownStrategy(
            f"strategy {name!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _in_package(module_name: str, root: str) -> bool:
    return module_name == root or module_name.startswith(root + ".")


@contextlib.contextmanager
def isolated_package(root: str) -> Iterator[dict[str, Any]]:
    """While the block runs, ``sys.modules`` holds none of package ``root``'s modules, so the imports in the block
    make new instances of them; afterwards the new instances (name -> module, yielded) are taken out again and the
    earlier ones put back.  The new instances reach each other through their own globals, as modules of one
    process do."""
    saved = {n: m for n, m in sys.modules.items() if _in_package(n, root)}
    for n in saved:
        del sys.modules[n]
    fresh: dict[str, Any] = {}
    try:
        yield fresh
    finally:
        for n in [n for n in sys.modules if _in_package(n, root)]:
            fresh[n] = sys.modules.pop(n)
        sys.modules.update(saved)


def fresh_package_module(name: str, module_name: str):
    """Module ``module_name`` from a new instance of its top-level package (see :func:`isolated_package`)."""
    root = module_name.partition(".")[0]
    with isolated_package(root):
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and _in_package(module_name, exc.name):
                raise UnknownStrategy(
                    f"strategy {name!r}: module {module_name!r} not found (is it on PYTHONPATH?)"
                ) from None
            raise UnknownStrategy(
                f"strategy {name!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a user's package failing to import is their
            # error, in one line
            raise UnknownStrategy(
                f"strategy {name!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
            ) from exc


def _check_signature(name: str, factory: Callable) -> Callable:
    """Workers call ``factory(group, expert_weights, expert_buffer, prev_communicator)``, positionally, as vLLM
    does; a factory that cannot take that is a bad ``--strategy``, said before the run rather than as a crash of
    every rank inside it."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (a builtin or an extension type): let the call decide
        return factory
    try:
        signature.bind(None, None, None, None)
    except TypeError as exc:
        raise UnknownStrategy(
            f"strategy {name!r} is not a strategy factory: "
            f"{getattr(factory, '__name__', 'it')}{signature} cannot be called as "
            f"factory(group, expert_weights, expert_buffer, prev_communicator), which returns an "
            f"EPLB communicator ({exc})"
        ) from None
    return factory
