"""Case registry, observation helpers and profile matching."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from fakes.nixl.profiles import PROFILES

CASES: dict[str, "Case"] = {}


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[[Any], Any]
    expect: Any  # the dram observation (real NIXL 1.5.1 on host memory)
    by_profile: dict[str, Any] = field(default_factory=dict)  # profiles that deliberately differ
    transport: str = "cma"  # "tcp": the real side runs under UCX_TLS=tcp, in a process of its own
    isolate: bool = False  # the real library may kill the process: run it in a child
    # "host-memory": skipped with --memory vram; "no-cuda-context": skipped for real NIXL in a process that has
    # initialised CUDA.  Each skip carries its reason.
    needs: tuple[str, ...] = ()
    doc: str = ""
    # What the fake does in every profile but dram where 1.5.1 hides a bug (a crash, a silent stale read): the
    # fake is deliberately stricter there, which is no claim about the hardware the profile models.
    hardened: Any = None
    has_hardened: bool = False

    def expected(self, profile: str) -> Any:
        """What the fake does in ``profile``."""
        if profile in self.by_profile:
            return self.by_profile[profile]
        if self.has_hardened and profile != "dram":
            return self.hardened
        return self.expect

    def on_hardware(self, profile: str) -> Any:
        """What the real library does on the hardware ``profile`` models (hardening does not apply)."""
        return self.by_profile.get(profile, self.expect)


_UNSET = object()


def case(
    expect: Any,
    *,
    transport: str = "cma",
    isolate: bool = False,
    needs: tuple[str, ...] = (),
    hardened: Any = _UNSET,
    **by_profile: Any,
) -> Callable:
    """Register a check.  Keyword arguments name profiles whose hardware differs from ``dram`` (``rocm_strict``
    for ``rocm-strict``); ``hardened`` is what the fake does instead of a 1.5.1 bug in every profile but dram."""

    def wrap(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        overrides = {k.replace("_", "-"): v for k, v in by_profile.items()}
        unknown = set(overrides) - set(PROFILES)
        if unknown:
            raise LookupError(f"case {fn.__name__}: unknown profiles {sorted(unknown)}")
        CASES[fn.__name__] = Case(
            fn.__name__,
            fn,
            plain(expect),
            {k: plain(v) for k, v in overrides.items()},
            transport,
            isolate or transport == "tcp",
            needs,
            (fn.__doc__ or "").strip(),
            None if hardened is _UNSET else plain(hardened),
            hardened is not _UNSET,
        )
        return fn

    return wrap


def plain(value: Any) -> Any:
    """Observations travel as JSON between processes: tuples become lists, so compare them in that form."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return value


def observe(fn: Callable[[], Any]) -> Any:
    """Run one step; its result, or the class name of what it raised (``SIGSEGV`` for a simulated crash)."""
    from fakes.nixl._status import SimulatedCrash

    try:
        return plain(fn())
    except SimulatedCrash as crash:
        return crash.signal
    except Exception as exc:  # noqa: BLE001 - the class name *is* the observation
        return type(exc).__name__


def expected(name: str, profile: str) -> Any:
    return CASES[name].expected(profile)


def matched_profile(observations: dict[str, Any], hardware: bool = True) -> str | None:
    """The profile whose every expectation holds for these observations (cases not run are ignored).

    ``hardware``: the observations come from a real library, judged against what each profile says of its
    hardware; otherwise from the fake, judged against what the fake does in each profile (hardening included).
    """
    for name in PROFILES:
        want = (lambda c: CASES[c].on_hardware(name)) if hardware else (lambda c: CASES[c].expected(name))
        if all(want(c) == obs for c, obs in observations.items() if c in CASES):
            return name
    return None
