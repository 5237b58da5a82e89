"""One tree of errors.  User mistakes also subclass the builtin a caller would expect (ValueError, LookupError),
and every message says how to fix the problem; the CLI prints it as one line and exits 2."""

from __future__ import annotations

import re

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


class EpsimError(Exception):
    """Base of every error epsim raises on purpose."""


class InternalError(Exception):
    """A bug in epsim itself (its engine failed), not in the code under test and not the user's input: no verdict,
    exit status 3, and a sweep records an ``error`` row instead of a failure bundle."""


class HarnessError(InternalError):
    """epsim could not judge the run: the code under test did its work outside the fakes (a module of it bound a
    real library before the fakes were installed).  Exit status 3, as for an internal error: no verdict."""


class ScenarioError(EpsimError, ValueError):
    """A scenario file or option is invalid."""


class UnknownStrategy(EpsimError, LookupError):
    """A communicator strategy name or ``module:factory`` path that cannot be found."""


class UnknownName(EpsimError, LookupError):
    """A profile, backend, case or other named thing that does not exist."""


class BackendUnavailable(EpsimError, RuntimeError):
    """An optional backend (real NIXL, a GPU, DeepEP) is not installed or not usable here."""


class BadOutput(EpsimError, ValueError):
    """An output path (``--out``, ``--bundles``, ``--corpus``) epsim cannot write to."""


def one_line(text: str) -> str:
    """``text`` with its line breaks as spaces: an error quotes paths and names, which may hold one."""
    return " ".join(text.splitlines())


def no_addresses(text: str) -> str:
    """``text`` with memory addresses (``<Foo object at 0x7f..>`` in a repr) as ``0x…``: what goes into a run's
    history must be the same in every process for the same seed."""
    return _ADDRESS.sub("0x…", text)


def exception_line(exc: BaseException) -> str:
    """``Type: message`` of an exception as a run's history and verdict keep it: no memory addresses."""
    return no_addresses(f"{type(exc).__name__}: {exc}")


def validation_line(exc) -> str:
    """``where: what`` for the first error of a pydantic ValidationError in a JSON file epsim reads (a calibration, a
    bundle's failure.json): one line, without pydantic's internal class names ("or instance of _Config")."""
    err = exc.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or "the file"
    return f"{where}: {err['msg'].split(' or instance of')[0]}"


def refuse_empty(option: str, values) -> None:
    """``--strategy ''`` or ``--profile ''`` would silently mean "the scenario's own": refuse it, for run and sweep."""
    if any(not v.strip() for v in values):
        raise ScenarioError(f"{option}: empty; leave it out for the scenario's own")


def prog() -> str:
    """How the user runs epsim, for the commands a hint tells them to type: ``./dev epsim`` when ./dev started it
    (it says so in EPSIM_PROG), else ``epsim``."""
    import os

    return os.environ.get("EPSIM_PROG", "").strip() or "epsim"
