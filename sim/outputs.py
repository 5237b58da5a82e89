"""Output paths checked before the work that fills them: a bad ``--out`` must cost one line, not a finished run.

Every command that writes files (``run``, ``replay``, ``shrink``, ``calibrate``, ``sweep``) asks here first; the
answer is the path, made if missing, or :class:`~sim.errors.BadOutput` naming the option and the reason.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .errors import BadOutput


def writable_dir(path: str | Path, option: str) -> Path:
    """``path`` as a directory this process can write into (made, with its parents, if missing)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise BadOutput(f"{option} {path}: that is a file; give a directory (it is made if missing)")
    _ensure(p, f"{option} {path}")
    return p


def writable_file(path: str | Path, option: str) -> Path:
    """``path`` as a file this process can create or replace (its directory made if missing)."""
    p = Path(path)
    if p.is_dir():
        raise BadOutput(f"{option} {path}: that is a directory; give a file name")
    _ensure(p.parent, f"{option} {path}")
    return p


def _ensure(directory: Path, what: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):  # mkdir succeeds on a directory that exists read-only
            pass
    except OSError as exc:
        raise BadOutput(f"{what}: cannot write there ({exc.strerror or exc}); give a path you can write to") \
            from None
