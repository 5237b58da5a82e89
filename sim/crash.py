"""What a crash verdict says about the exception that escaped the code under test: its chain of causes and the
frames it was raised through.

vLLM wraps errors (``RuntimeError("Failed to initialize NixlEplbCommunicator (...)")`` raised ``from`` the NIXL
error), so the outer type alone says little.  :func:`describe` turns an exception into plain data:

- ``chain``: the exception, then what it was raised from (``__cause__``, ``via: "cause"``) or while handling
  (``__context__``, ``via: "context"``), down to the root cause, as Python's traceback walks it;
- ``frames``: the stack the root cause was raised through, outermost first, innermost last: the innermost
  :data:`MAX_FRAMES`, without epsim's own frames (the simulation, the fakes, the real backend's rank process,
  greenlet, simpy); each frame's ``kind`` says whether it is the code under test (``code``) or a library
  (``library``: the standard library and installed packages other than vLLM);
- ``origin``: the innermost function of the code under test (its qualified name), what sweep signatures name.

Paths are relative to site-packages or the working directory where they lie under one (vLLM's sources in a tree or
in epsim's cache: from their ``vllm/`` package on), so results compare across machines.  None of this enters a run's
history (and so its trace hash): line numbers change with every edit.
"""

from __future__ import annotations

import functools
import linecache
import os
import site
import sys
import sysconfig
from pathlib import Path
from typing import Any

from .errors import no_addresses, one_line

MAX_FRAMES = 12  # innermost frames kept
MAX_CHAIN = 8  # links of the chain kept, from the outermost
MAX_MESSAGE = 500  # characters of a message kept
MAX_CODE = 160  # characters of a frame's source line kept

_ROOT = Path(__file__).resolve().parent.parent  # the epsim checkout
_HARNESS_DIRS = tuple(str(_ROOT / d) + os.sep for d in ("sim", "fakes", "real_backends"))
# Inside sim/: the built-in strategies, which are code under test (sim/vllm/ is not: it loads vLLM's own files, which
# lie in site-packages, a source tree or epsim's cache, and stands in for the modules they cannot import here).
_UNDER_TEST_DIRS = (str(_ROOT / "sim" / "eplb" / "communicators") + os.sep,)
_HARNESS_FILES = {str(_ROOT / "sim" / "eplb" / "communicators" / "plugins.py")}
_VLLM = os.sep + "vllm" + os.sep  # vLLM's package directory, wherever its sources lie
_HARNESS_PACKAGES = {"greenlet", "simpy"}  # installed packages that run the simulation
_UNDER_TEST_PACKAGES = {"vllm"}  # installed packages that are code under test, not a library
_HARNESS_STDLIB = {"threading.py"}  # a thread's bootstrap


def _site_dirs() -> tuple[str, ...]:
    dirs = set(site.getsitepackages() if hasattr(site, "getsitepackages") else ())
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if isinstance(user, str):
        dirs.add(user)
    dirs.update(p for p in sys.path if p.rstrip(os.sep).endswith(("site-packages", "dist-packages")))
    # Longest first: a site-packages inside another folder that is itself on the list wins.
    return tuple(sorted((os.path.realpath(d) + os.sep for d in dirs), key=len, reverse=True))


_SITE = _site_dirs()
_STDLIB = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})


@functools.lru_cache(maxsize=1024)
def _place(filename: str) -> tuple[str, str]:
    """(kind, shown path) of a frame's file: kind ``harness``, ``library`` or ``code``."""
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return "library", filename
    path = os.path.realpath(filename)
    for d in _SITE:
        if path.startswith(d):
            rel = path[len(d) :]
            top = rel.split(os.sep, 1)[0].removesuffix(".py").split(".", 1)[0]
            kind = "harness" if top in _HARNESS_PACKAGES else "code" if top in _UNDER_TEST_PACKAGES else "library"
            return kind, rel
    shown = _shown(path)
    for d in _STDLIB:
        if path.startswith(d) and "site-packages" not in path:
            return ("harness" if path[len(d) :] in _HARNESS_STDLIB else "library"), shown
    if path in _HARNESS_FILES:
        return "harness", shown
    if path.startswith(_UNDER_TEST_DIRS):
        return "code", shown
    if path.startswith(_HARNESS_DIRS):
        return "harness", shown
    if shown == path and _VLLM in path:  # vLLM's sources in a tree or epsim's cache: from the package on
        shown = path[path.rindex(_VLLM) + 1 :]
    return "code", shown


def _shown(path: str) -> str:
    """``path`` relative to the working directory if it lies under it, else as it is."""
    try:
        cwd = os.path.realpath(os.getcwd()) + os.sep
    except OSError:  # the working directory was removed
        return path
    return path[len(cwd) :] if path.startswith(cwd) else path


def _message(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception as err:  # noqa: BLE001 - a __str__ that raises still leaves its type to report
        text = f"<str() failed: {type(err).__name__}>"
    text = no_addresses(text)
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def chain(exc: BaseException) -> list[tuple[BaseException, str | None]]:
    """(exception, how it hangs off the one before) from ``exc`` to its root cause, as Python's traceback walks it:
    ``__cause__`` first, else ``__context__`` unless suppressed (``raise ... from None``)."""
    links: list[tuple[BaseException, str | None]] = []
    seen: set[int] = set()
    via: str | None = None
    while exc is not None and id(exc) not in seen and len(links) < MAX_CHAIN:
        seen.add(id(exc))
        links.append((exc, via))
        if exc.__cause__ is not None:
            exc, via = exc.__cause__, "cause"
        elif exc.__context__ is not None and not exc.__suppress_context__:
            exc, via = exc.__context__, "context"
        else:
            break
    return links


def _entries(exc: BaseException) -> list[tuple[Any, int]]:
    out, tb = [], exc.__traceback__
    while tb is not None:
        out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out


def _stack(links: list[tuple[BaseException, str | None]]) -> list[tuple[Any, int]]:
    """The frames the root cause was raised through, outermost first: the root's own traceback (from the frame
    that caught it) below the frames of each outer exception's traceback above that frame."""
    stack: list[tuple[Any, int]] = []
    for exc, _ in reversed(links):
        outer = _entries(exc)
        if not stack:
            stack = outer
            continue
        joint = next((i for i in range(len(outer) - 1, -1, -1) if outer[i][0] is stack[0][0]), None)
        if joint is None:  # raised elsewhere than where the inner one was caught: the inner stack is the story
            break
        stack = outer[:joint] + stack
    return stack


def _frame(frame, lineno: int) -> dict[str, Any]:
    code = frame.f_code
    kind, shown = _place(code.co_filename)
    line = linecache.getline(code.co_filename, lineno).strip()
    if len(line) > MAX_CODE:
        line = line[: MAX_CODE - 1] + "…"
    return {
        "file": shown,
        "line": lineno,
        "function": getattr(code, "co_qualname", code.co_name),
        "code": line,
        "kind": kind,
    }


def describe(exc: BaseException, thread: str | None = None, pid: int | None = None) -> dict[str, Any]:
    """``exc`` (with its ``__traceback__``) as plain data: ``thread``, ``pid``, ``chain``, ``frames``,
    ``frames_omitted`` and ``origin`` (see the module's description)."""
    links = chain(exc)
    stack = [_frame(f, n) for f, n in _stack(links)]
    shown = [f for f in stack if f["kind"] != "harness"] or stack  # only epsim's frames: those, marked
    origin = next((f["function"] for f in reversed(stack) if f["kind"] == "code"), None)
    harness = len(stack) - len(shown)
    outer = max(0, len(shown) - MAX_FRAMES)
    return {
        "thread": thread,
        "pid": pid,
        "chain": [{"type": type(e).__name__, "message": _message(e), "via": via} for e, via in links],
        "frames": shown[outer:],
        "frames_omitted": {"harness": harness, "outer": outer},
        "origin": origin,
    }


def line(crash: dict[str, Any]) -> str:
    """``Type: message`` of the outer exception, and `` <- Type: message`` of the root cause when there is one."""
    links = crash["chain"]
    text = f"{links[0]['type']}: {links[0]['message']}"
    if len(links) > 1:
        text += f" <- {links[-1]['type']}: {links[-1]['message']}"
    return text


def signature_part(crash: dict[str, Any]) -> str:
    """``Outer[<-Root][@origin]``: what a crash's signature names (see :func:`sim.run.signature`)."""
    links = crash["chain"]
    part = links[0]["type"]
    if len(links) > 1:
        part += f"<-{links[-1]['type']}"
    if crash.get("origin"):
        part += f"@{crash['origin']}"
    return part


def readable(crash: dict[str, Any], frames: int = 5) -> list[str]:
    """Lines for the human output: the chain, then the innermost ``frames`` frames."""
    out = []
    links = crash["chain"]
    if len(links) > 2:  # two are in the verdict's line already
        out.append("exception chain (outermost first):")
        for i, link in enumerate(links):
            how = "" if i == 0 else "  <- cause: " if link["via"] == "cause" else "  <- while handling: "
            out.append(f"  {how}{link['type']}: {one_line(link['message'])}")
    shown = crash["frames"][-frames:]
    if shown:
        out.append(
            "raised at (innermost last; --json has the rest):"
            if len(crash["frames"]) > len(shown)
            else "raised at (innermost last):"
        )
        for f in shown:
            mark = "" if f["kind"] == "code" else f" [{f['kind']}]"
            out.append(f"  {f['file']}:{f['line']} in {f['function']}{mark}" + (f": {f['code']}" if f["code"] else ""))
    return out
