"""One tree of errors.  User mistakes also subclass the builtin a caller would expect (ValueError, LookupError),
and every message says how to fix the problem; the CLI prints it as one line and exits 2."""

from __future__ import annotations


class EpsimError(Exception):
    """Base of every error epsim raises on purpose."""


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
