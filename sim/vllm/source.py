"""Where vLLM's EPLB sources come from: the installed ``vllm``, a source tree or wheel the user names, or the
released 0.33.0 wheel fetched once into epsim's cache.

Only Python sources are read, never imported as an installed vLLM would be: a whole vLLM import needs a GPU build
of torch and a distributed runtime.  Nothing of vLLM is stored in this repository; the cache lives in
``$EPSIM_CACHE`` (default ``$XDG_CACHE_HOME/epsim``, else ``~/.cache/epsim``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from sim.errors import UnknownStrategy

RELEASED = "0.33.0"
COMMUNICATOR = "vllm/distributed/eplb/eplb_communicator.py"
# The files of the code under test whose bytes a result names (by digest), so a verdict says what it judged.
UNDER_TEST = (COMMUNICATOR, "vllm/distributed/nixl_utils.py", "vllm/distributed/eplb/eplb_utils.py")
# What a wheel gives the cache: the distributed package (the code under test and its neighbours) and the version.
_EXTRACT = re.compile(r"^vllm/(distributed/.*\.py|_version\.py)$")


@dataclass(frozen=True)
class VllmSource:
    root: Path  # the directory holding the ``vllm`` package
    version: str
    origin: str  # how it was found, for people: "installed", "wheel PATH", "source tree PATH", "vllm==X (cached)"

    def digest(self) -> str:
        """sha256 (16 hex digits) over the files under test, in order."""
        h = hashlib.sha256()
        for rel in UNDER_TEST:
            path = self.root / rel
            h.update(rel.encode() + b"\0" + (path.read_bytes() if path.exists() else b"<missing>") + b"\0")
        return h.hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("EPSIM_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "epsim"


def locate(path: str | None) -> VllmSource:
    """The sources of ``--strategy vllm[:PATH]``; UnknownStrategy (one line) if there are none."""
    if path:
        return _from_path(Path(path).expanduser())
    installed = _installed()
    return installed if installed is not None else released()


def _installed() -> VllmSource | None:
    try:
        spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]).parent
    if not (root / COMMUNICATOR).is_file():
        return None
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = _tree_version(root)
    return VllmSource(root, version, "installed")


def _tree_version(root: Path) -> str:
    text = (root / "vllm" / "_version.py").read_text() if (root / "vllm" / "_version.py").is_file() else ""
    found = re.search(r"""(?:__version__|version)\s*(?::\s*str)?\s*=\s*['"]([^'"]+)['"]""", text)
    return found.group(1) if found else "unknown (source tree)"


def _from_path(path: Path) -> VllmSource:
    if path.is_file() and path.suffix == ".whl":
        return _from_wheel(path)
    for root in (path, path.parent):  # a checkout's root, or its ``vllm`` package folder
        if (root / COMMUNICATOR).is_file():
            return VllmSource(root.resolve(), _tree_version(root), f"source tree {path}")
    raise UnknownStrategy(
        f"strategy 'vllm:{path}': no {COMMUNICATOR} under {path} (give a vLLM checkout, its "
        f"vllm/ folder, or a vLLM wheel)"
    )


def _from_wheel(wheel: Path) -> VllmSource:
    stat = wheel.stat()
    where = cache_dir() / "wheels" / f"{wheel.stem}-{stat.st_size}"
    if not (where / COMMUNICATOR).is_file():
        with _locked(where):
            if not (where / COMMUNICATOR).is_file():
                _extract(wheel, where)
    return VllmSource(where, _tree_version(where), f"wheel {wheel}")


def _extract(wheel: Path, where: Path) -> None:
    """The wheel's sources under ``where``, complete or not at all (extracted beside it, then renamed)."""
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=where.name + ".", dir=where.parent))
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if _EXTRACT.match(n)]
            if "vllm/distributed/eplb/eplb_communicator.py" not in names:
                raise UnknownStrategy(f"{wheel} holds no {COMMUNICATOR}: not a vLLM wheel with NIXL EPLB")
            for n in names:
                zf.extract(n, tmp)
        if where.exists():
            shutil.rmtree(where)
        tmp.rename(where)
    except (OSError, zipfile.BadZipFile) as exc:
        raise UnknownStrategy(f"cannot read the vLLM wheel {wheel}: {exc}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def released() -> VllmSource:
    """vLLM 0.33.0 as released: its wheel's sources, fetched into the cache on first use."""
    where = cache_dir() / f"vllm-{RELEASED}"
    if not (where / COMMUNICATOR).is_file():
        with _locked(where):  # sweep workers and test workers may all ask at once: one fetches
            if not (where / COMMUNICATOR).is_file():
                fetch_released(where)
    return VllmSource(where, RELEASED, f"vllm=={RELEASED} (cached in {where})")


@contextlib.contextmanager
def _locked(where: Path) -> Iterator[None]:
    import fcntl

    where.parent.mkdir(parents=True, exist_ok=True)
    with open(where.parent / f".{where.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def fetch_released(where: Path) -> None:
    """``pip download --no-deps vllm==0.33.0`` into a temporary folder, its sources into ``where``; the wheel
    itself (336 MB) is not kept."""
    print(f"epsim: fetching vllm=={RELEASED}'s sources into {where} (once)", file=sys.stderr, flush=True)
    where.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="epsim-vllm-wheel.", dir=where.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            f"vllm=={RELEASED}",
            "-d",
            tmp,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("vllm-*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise UnknownStrategy(
                f"strategy 'vllm': vllm=={RELEASED}'s sources are not cached and pip could not "
                f"fetch the wheel ({last}); install vllm, or pass --strategy vllm:PATH with a vLLM "
                f"checkout or wheel"
            )
        _extract(wheels[0], where)
