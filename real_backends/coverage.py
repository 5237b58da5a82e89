"""Compare the fake NIXL's surface with the real one: ``python -m real_backends.coverage > docs/fake_coverage.md``.

Gaps are listed, not discovered: a test runs :func:`surface_gaps` against the installed real NIXL and fails if the
fake lacks a public name the real ``_api``/``_bindings`` has, unless it is listed in ``NOT_MODELLED`` with a reason.
"""

from __future__ import annotations

import inspect
import sys

from fakes.nixl import _api as fake_api
from fakes.nixl import _bindings as fake_bindings
from fakes.nixl import _utils as fake_utils
from fakes.nixl import logging as fake_logging

# Public names of the real modules the fake deliberately leaves out, and why.
NOT_MODELLED: dict[str, str] = {
    "_api.logger": "the fake logs to the 'epsim.fakes.nixl' logger",
    "logging.LOGGING_CONFIG": "NIXL's dictConfig; the fake's setup_logging sets the same logger up directly",
    "_api.TYPE_CHECKING": "typing constant",
    "_api.Enum": "a name the real module imports, not API",
    "_api.Optional": "typing alias",
    "_api.Union": "typing alias",
}

CLASSES = ("nixl_agent", "nixl_agent_config", "nixl_xfer_handle", "nixl_prepped_dlist_handle")
BINDING_CLASSES = ("nixlAgent", "nixlRegDList", "nixlXferDList", "nixlRemoteDList")


def _public(obj) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def real_extras(package: str) -> dict[str, object]:
    """The real package's other modules that NIXL's own tests import (``_utils``, ``logging``), by short name."""
    import importlib

    return {name: importlib.import_module(f"{package}.{name}") for name in ("_utils", "logging")}


def surface(real_api, real_bindings, extras: dict[str, object] | None = None) -> list[tuple[str, str, str]]:
    """Rows (name, status, note) for every public name of the real modules and classes (``extras``: the real
    ``_utils`` and ``logging`` modules too)."""
    rows = []
    modules = [("_api", real_api, fake_api), ("_bindings", real_bindings, fake_bindings)]
    fakes_of = {"_utils": fake_utils, "logging": fake_logging}
    modules += [(name, real, fakes_of[name]) for name, real in (extras or {}).items()]
    for mod_name, real, fake in modules:
        for name in sorted(_public(real)):
            key = f"{mod_name}.{name}"
            if inspect.ismodule(getattr(real, name)):
                continue
            if hasattr(fake, name):
                rows.append((key, "yes", ""))
            else:
                rows.append((key, "no", NOT_MODELLED.get(key, "MISSING")))
    for mod, fake_mod, names in (("_api", fake_api, CLASSES), ("_bindings", fake_bindings, BINDING_CLASSES)):
        real_mod = real_api if mod == "_api" else real_bindings
        for cls in names:
            real_cls, fake_cls = getattr(real_mod, cls), getattr(fake_mod, cls)
            for name in sorted(_public(real_cls)):
                key = f"{mod}.{cls}.{name}"
                if hasattr(fake_cls, name):
                    note = ""
                    real_m, fake_m = getattr(real_cls, name), getattr(fake_cls, name)
                    if mod == "_api" and inspect.isfunction(real_m) and inspect.isfunction(fake_m):
                        if list(inspect.signature(real_m).parameters) != list(inspect.signature(fake_m).parameters):
                            note = f"signature differs: real {inspect.signature(real_m)}"
                    rows.append((key, "yes" if not note else "differs", note))
                else:
                    rows.append((key, "no", NOT_MODELLED.get(key, "MISSING")))
    return rows


def surface_gaps(real_api, real_bindings, extras: dict[str, object] | None = None) -> list[tuple[str, str, str]]:
    return [r for r in surface(real_api, real_bindings, extras) if r[1] == "differs" or r[2] == "MISSING"]


NOTES = """
Behaviour, not only names: `tests/conformance/` runs the behaviour catalogue against both. Methods that exist in
the fake but are not modelled in depth: `send_local_metadata`, `send_partial_agent_metadata`,
`fetch_remote_metadata` and `invalidate_local_metadata` towards an address (the fake has no sockets: it logs and
returns, as the real one does before its asynchronous exchange); `prep_mem_view` (the fake has no GPU device API:
nixlBackendError, as a UCX built without it). Plugins: `get_plugin_list` lists UCX and POSIX; of POSIX the fake
models its parameters and `query_memory` (a file's size, mode and modification time), and refuses registrations
and transfers through it (NIXL_ERR_NOT_SUPPORTED, saying so); `query_memory` through UCX is NOT_SUPPORTED, as
1.5.1's. NIXL's own Python tests (`test/python` of the NIXL repository) pass against the fake where they pass
against 1.5.1: `pytest --fake-nixl test/python` (docs/nixl-fake.md).
"""


def main() -> int:
    from real_backends.nixl_real import NixlUnavailable, import_real_nixl

    try:
        real_api, real_bindings, package = import_real_nixl()
    except NixlUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = surface(real_api, real_bindings, real_extras(package))
    print("# Fake NIXL coverage of the real 1.5.1 surface\n")
    print(
        f"Generated by `python -m real_backends.coverage` against `{package}`. "
        f"{sum(r[1] == 'yes' for r in rows)} of {len(rows)} public names are present with the real signature.\n"
    )
    print("| name | in the fake | note |\n|---|---|---|")
    for name, status, note in rows:
        print(f"| `{name}` | {status} | {note} |")
    print(NOTES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
