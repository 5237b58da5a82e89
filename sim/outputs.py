"""Output paths checked before the work that fills them: a bad ``--out`` must cost one line, not a finished run,
and nothing already written may be lost.

Every command that writes files (``run``, ``replay``, ``shrink``, ``calibrate``, ``sweep``) asks here first; the
answer is the path (made if missing, except a run's ``--out``, which is made when its files are written) or
:class:`~sim.errors.BadOutput` naming the option and the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

from .errors import BadOutput

# What a run writes into its --out folder (sim/run.py, real_backends/run.py) and a bundle holds beside failure.json.
RUN_FILES = ("history.jsonl", "trace.perfetto.json", "tape.json", "result.json")


class OutputFailed(BadOutput):
    """A finished run whose files could not all be written: the result is kept, to be printed before the error."""

    def __init__(self, message: str, result: Any) -> None:
        super().__init__(message)
        self.result = result


def write_run_files(out: str | Path, writers: dict[str, Callable[[Path], object]], result: Any) -> None:
    """A run's files into ``out``: every one written under a temporary name first, and only when all are written
    moved over the old ones, so a failed write (a full disk) leaves the earlier run's files whole and together; the
    run files this run does not make are removed, so that a folder never mixes two runs (a real run writes no tape).
    An error is :class:`OutputFailed`, carrying ``result``."""
    out = Path(out)
    parts: list[tuple[Path, Path]] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, write in writers.items():
            part = out / f".{name}.part"
            parts.append((part, out / name))
            write(part)
        for part, final in parts:  # a rename within one folder needs no new space
            os.replace(part, final)
        for name in RUN_FILES:
            if name not in writers:
                (out / name).unlink(missing_ok=True)
    except OSError as exc:
        for part, _ in parts:
            with contextlib.suppress(OSError):  # what could not be written may not be removable either
                part.unlink(missing_ok=True)
        raise OutputFailed(f"--out {out}: could not write the run's files ({exc.strerror or exc})", result) from None


def write_replacing(path: str | Path, write: Callable[[Path], object]) -> None:
    """The file ``path`` as ``write`` writes it into a file beside it, moved over the old one only once written
    whole: a write that fails half-way (a full disk) leaves the earlier file as it was.  An error is the
    ``OSError``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):  # what could not be written may not be removable either
            tmp.unlink(missing_ok=True)


def write_file_replacing(path: str | Path, text: str) -> None:
    """``text`` into the file ``path``, as :func:`write_replacing` writes."""
    write_replacing(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def writable_dir(path: str | Path, option: str, files: Iterable[str] = RUN_FILES, *, make: bool = True) -> Path:
    """``path`` as a directory this process can write into, in which none of ``files`` (the names the command will
    write) is a directory.  ``make``: make it now, with its parents, if missing; else only check that it could be
    made (a command refused later, or one that fails, then leaves no empty folder behind)."""
    p = _nonempty(path, option)
    if p.exists() and not p.is_dir():
        raise BadOutput(f"{option} {path}: that is a file; give a directory (it is made if missing)")
    for name in files:
        if (p / name).is_dir():
            raise BadOutput(f"{option} {path}: {name} there is a directory, where epsim writes a file of that name")
        if (p / name).exists() and not (p / name).is_file():  # a FIFO or a device: reading or writing it may block
            raise BadOutput(
                f"{option} {path}: {name} there is not a regular file, where epsim writes a file of that name"
            )
    if make or p.is_dir():
        _ensure(p, f"{option} {path}")
    else:
        _ensure(_nearest_dir(p, option, path), f"{option} {path}")
    return p


def run_dir(path: str | Path, option: str) -> Path:
    """``path`` as a folder a run's files may be written into: new, empty, holding none of them, or an earlier
    run's (whose run files are replaced, other files kept).  A folder holding files of those names that are not an
    earlier run's (no ``result.json`` epsim wrote) is refused: they may be someone's own.  A missing folder is only
    checked here; :func:`write_run_files` makes it, so a run stopped with Ctrl-C leaves no empty folder behind."""
    p = writable_dir(path, option, make=False)
    present = [name for name in RUN_FILES if (p / name).exists()]
    if present and not _earlier_run(p / "result.json"):
        raise BadOutput(
            f"{option} {path}: it holds {', '.join(present)}, which no earlier epsim run wrote (no "
            f"result.json of one); give a new or empty directory, or an earlier run's folder"
        )
    return p


def _earlier_run(result: Path) -> bool:
    try:
        data = json.loads(result.read_text())
    except (OSError, ValueError, RecursionError):  # (nested past the parser's depth: not epsim's either)
        return False
    return isinstance(data, dict) and {"verdict", "trace_hash", "seed", "strategy"} <= data.keys()


def writable_file(path: str | Path, option: str) -> Path:
    """``path`` as a file this process can create or replace (its directory made if missing)."""
    p = _nonempty(path, option)
    if p.is_dir():
        raise BadOutput(f"{option} {path}: that is a directory; give a file name")
    _nearest_dir(p, option, path)  # a file on the way is named, not left to mkdir's "Not a directory"
    _ensure(p.parent, f"{option} {path}")
    return p


def bundle_dir(path: str | Path, option: str, *, source: str | Path | None = None, make: bool = True) -> Path:
    """``path`` as a folder a failure bundle may be written into: new, empty, or a bundle (whose own files are
    replaced, other files kept); never the bundle ``source`` being read, nor a folder that holds it.  ``make``: as
    for :func:`writable_dir`."""
    p = writable_dir(path, option, files=("failure.json", "scenario.yaml", *RUN_FILES), make=make)
    if source is not None:
        src, dst = Path(source).resolve(), p.resolve()
        if src == dst or dst in src.parents:
            raise BadOutput(
                f"{option} {path}: that {'is' if src == dst else 'holds'} the bundle being read "
                f"({source}); give another directory"
            )
    if p.is_dir() and any(p.iterdir()) and not (p / "failure.json").is_file():
        raise BadOutput(
            f"{option} {path}: the directory holds other files and is not a failure bundle; give a new "
            f"or empty directory, or a bundle to replace"
        )
    return p


def _nearest_dir(p: Path, option: str, path: str | Path) -> Path:
    """The closest of ``p``'s parents that exists, which must be a directory."""
    existing = next(a for a in p.absolute().parents if a.exists())
    if not existing.is_dir():
        raise BadOutput(f"{option} {path}: {existing} is a file, not a directory")
    return existing


def _nonempty(path: str | Path, option: str) -> Path:
    if not str(path).strip():
        raise BadOutput(f"{option}: an empty path; give a name")
    return Path(path)


def _ensure(directory: Path, what: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):  # mkdir succeeds on a directory that exists read-only
            pass
    except OSError as exc:
        raise BadOutput(f"{what}: cannot write there ({exc.strerror or exc}); give a path you can write to") from None
