"""``epsim validate``: the simulation's predictions checked against the real backend on this machine.

Two parts.  The NIXL behaviour catalogue runs on the real library and each case's observation is compared with what
the fake's profile for this hardware predicts (``dram`` on host memory, ``cuda`` on VRAM).  Then a small scenario
set runs twice, simulated under that profile and on real rank processes, with the same scenario, seed, strategy and
faults; a case agrees when the verdict, the invariant (for a crash, the exception type) and the registration
ledger's counts are the same.  Every disagreement is a finding; docs/validation.md explains the known ones.

One known disagreement is checked on the spot: on a GPU the copy/READ race (sim/device.py) breaks the weights with
no lag injected when the streams fall behind by themselves, which the simulation does only when told.  A case whose
real weights broke while the simulated ones did not is simulated once more with the streams lagged; the row says
whether that gives the real outcome.  The case still disagrees: the prediction without lag was wrong.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sim import scenario as scenario_mod
from sim.calibration import BUNDLED
from sim.run import Result, run_scenario

from .run import run_real

LEDGER = (
    "registrations",
    "duplicate_registrations",
    "agents_created",
    "max_live_agents_per_process",
    "transfers",
    "bytes_moved",
)
STREAM_LAG = "device.stream_lag:delay_s=0.01"  # what the lagged cases inject, and the check of a race without it
UP_2_TO_3 = {"timeline.0.to": 3, "max_ranks": 3}
DOWN_3_TO_2 = {"ranks": 3, "timeline.0.to": 2}
UP_2_TO_4 = {"timeline.0.to": 4, "max_ranks": 4}
DOWN_4_TO_2 = {"ranks": 4, "timeline.0.to": 2}
STRATEGIES = ("per-communicator-agent", "arena-registry", "shared-agent")


@dataclass(frozen=True)
class Case:
    scenario: str
    strategy: str
    overrides: dict[str, Any] = field(default_factory=dict)
    faults: tuple[str, ...] = ()
    quick: bool = False  # in the --quick set
    device: str | None = None  # the one device it runs on (a fault the real backend injects only there), or any
    # On a GPU, the host in step with it (vLLM without async scheduling), so that the agent lifecycle decides the
    # case; False: vLLM's defaults, where a step's forward work is still queued when EPLB runs (sim/device.py).
    in_step: bool = True
    # A verdict that turns on how long things take: the simulated side runs with the calibration run_validation is
    # given (the simulation's default clock takes no time for a rank's exit; a real one takes about half a second).
    timed: bool = False
    deep_ep: bool = False  # needs a real DeepEP build (skipped, with the reason, where none imports)

    @property
    def name(self) -> str:
        size = ""
        if self.overrides:
            sc = self.load()
            size = " " + "->".join(str(n) for n in sc.ep_sizes())
        host = "" if self.in_step else " · vLLM's defaults"
        timed = " · calibrated" if self.timed else ""
        return f"{self.scenario}{size} · {self.strategy}" + "".join(f" · {f}" for f in self.faults) + host + timed

    def load(self, device: str = "cpu"):
        overrides = dict(self.overrides)
        if device == "cuda" and self.in_step:
            overrides["serving.async_scheduling"] = False
        sc = scenario_mod.load(self.scenario)
        return scenario_mod.with_overrides(sc, **overrides) if overrides else sc


# The --quick set (what CI runs through `epsim validate`) leaves out what tests/real/test_real_runs.py runs anyway.
CASES: list[Case] = [
    Case("steady", "shared-agent", quick=True),
    *(Case("scale-up", s, UP_2_TO_3) for s in STRATEGIES),
    *(Case("scale-down", s, DOWN_3_TO_2) for s in STRATEGIES),
    Case("abort", "per-communicator-agent"),
    Case("elastic-cycle", "shared-agent"),
    Case("rank-failure", "shared-agent", quick=True),
    # The GC and worker faults the real backend does for real.  gc.late waits 10 s: far longer than the ~2 s a
    # rank with live agents takes to exit, so the late finalizer still runs after the reconfiguration in both
    # worlds (with 2 s the real verdict depends on that race; docs/validation.md).
    *(
        Case("scale-down", "per-communicator-agent", DOWN_3_TO_2, (f,), quick=f in ("gc.thread", "storage.move"))
        for f in ("gc.late:delay_s=10", "gc.cycle", "gc.thread", "gc.never", "peer.restart", "storage.move")
    ),
    # gc.late on either side of the departing rank's exit, which takes a real rank about half a second (a last
    # collection, the process's teardown): finalized before it, the survivors' old communicator removes the peer in
    # time (pass); after it, the peer is still loaded when the reconfiguration completes (stale_peer).  Only a
    # calibrated clock gives the exit its duration: uncalibrated, the first case would be stale_peer too.
    *(
        Case("scale-down", "per-communicator-agent", DOWN_3_TO_2, (f"gc.late:delay_s={d}",), quick=True, timed=True)
        for d in (0.05, 5)
    ),
    # The copy/READ race on VRAM (sim/device.py): each rank's stream 10 ms behind its row copies.  Both zero-copy
    # strategies are predicted to fail expert_weights; the real backend can only lag a CUDA stream.
    *(Case("scale-up", s, UP_2_TO_3, (STREAM_LAG,), device="cuda") for s in ("shared-agent", "per-communicator-agent")),
    # The same race with no fault under vLLM's defaults (async scheduling: a step's forward work queued when EPLB
    # runs): expert_weights for a zero-copy strategy, a pass for one that synchronizes the stream before its READs.
    *(
        Case("scale-up", s, UP_2_TO_3, device="cuda", in_step=False)
        for s in ("shared-agent", "tests.strategies.stream_synced:create")
    ),
    # Real DeepEP buffers (intranode, high throughput: 2, 4 or 8 ranks, sharing the GPUs there are) through a
    # scale-up and a scale-down: the simulation predicts vLLM 0.33.0's old buffers dropped without destroy() at the
    # switch, which DeepEP only warns about (safety: leak); and a late collection of the old buffer.
    *(
        Case(
            scenario,
            strategy,
            {**sizes, "all2all.backend": "deepep_high_throughput"},
            faults,
            device="cuda",
            deep_ep=True,
        )
        for scenario, strategy, sizes, faults in (
            ("scale-up", "shared-agent", UP_2_TO_4, ()),
            ("scale-down", "per-communicator-agent", DOWN_4_TO_2, ()),
            ("scale-down", "per-communicator-agent", DOWN_4_TO_2, ("gc.late:what=buffer,delay_s=1",)),
        )
    ),
]


def predicted_profile(device: str) -> str:
    return "cuda" if device == "cuda" else "dram"


# A calibrated PREPARE builds at the end of its serving window and takes time, so the simulation serves one more
# chunk of steps while it builds, where the real parent waits for the build (to serve the steps an uncalibrated
# simulation serves): the load window, and with it the placements and the READs, differ.  Timed cases compare the
# other counts.
SERVING_COUNTS = ("transfers", "bytes_moved")


def compare(sim: Result, real: Result, timed: bool = False) -> tuple[bool, list[str]]:
    """(agree, what differs): outcome first, then the ledger's counts (``timed``: not the READs; above)."""
    diffs = []
    if (sim.verdict, sim.invariant) != (real.verdict, real.invariant):
        diffs.append(f"verdict {sim.verdict}/{sim.invariant} vs {real.verdict}/{real.invariant}")
    elif sim.verdict == "crash" and sim.signature != real.signature:
        diffs.append(f"crash {sim.signature} vs {real.signature}")
    if sim.verdict != "crash":  # a crash stops the others at a moment the host's timing picks
        for key in LEDGER:
            if timed and key in SERVING_COUNTS:
                continue
            if sim.metrics.get(key) != real.metrics.get(key):
                diffs.append(f"{key} {sim.metrics.get(key)} vs {real.metrics.get(key)}")
    return not diffs, diffs


def run_case(case: Case, device: str, timeout_s: float, calibration=None) -> dict[str, Any]:
    sc = case.load(device)
    sim = run_scenario(
        sc,
        strategy=case.strategy,
        profile=predicted_profile(device),
        faults=list(case.faults),
        calibration=calibration if case.timed else None,
    )
    real = run_real(sc, strategy=case.strategy, faults=list(case.faults), device=device, timeout_s=timeout_s)
    agree, diffs = compare(sim, real, case.timed)
    row = {
        "case": case.name,
        "scenario": case.scenario,
        "strategy": case.strategy,
        "overrides": case.overrides,
        "faults": list(case.faults),
        "agree": agree,
        "differences": diffs,
        "sim": _brief(sim),
        "real": _brief(real),
    }
    lagged = with_stream_lag(case, device, sim, real)
    if lagged is not None:
        row["with_stream_lag"] = lagged
    return row


def with_stream_lag(case: Case, device: str, sim: Result, real: Result) -> dict[str, Any] | None:
    """The simulation of ``case`` again with every rank's stream lagged, when the real run on a GPU broke the weights
    and the simulation without lag did not (else None): ``matches_real`` says whether it then gives the real
    verdict and invariant, i.e. whether the copy/READ race explains the disagreement."""
    if (
        device != "cuda"
        or real.invariant != "expert_weights"
        or sim.invariant == "expert_weights"
        or any(f.startswith("device.stream_lag") for f in case.faults)
    ):
        return None
    lagged = run_scenario(
        case.load(device), strategy=case.strategy, profile=predicted_profile(device), faults=[*case.faults, STREAM_LAG]
    )
    return {
        "fault": STREAM_LAG,
        "sim": _brief(lagged),
        "matches_real": (lagged.verdict, lagged.invariant) == (real.verdict, real.invariant),
    }


def _brief(r: Result) -> dict[str, Any]:
    return {
        "verdict": r.verdict,
        "invariant": r.invariant,
        "detail": r.detail,
        "signature": r.signature,
        "ledger": {k: r.metrics.get(k) for k in LEDGER},
        "wall_s": r.wall_s,
        "profile": r.profile,
    }


def conformance(device: str) -> dict[str, Any]:
    from sim import conform

    memory = "vram" if device == "cuda" else "dram"
    report = conform.run("real", predicted_profile(device), memory)
    cases = [
        {"name": c["name"], "outcome": c["outcome"], "observed": c["observed"], "expected": c["expected"]}
        for c in report["cases"]
    ]
    return {
        "memory": memory,
        "profile": predicted_profile(device),
        "matched_profile": report["matched_profile"],
        "cases": cases,
        "notes": report["notes"],
        "agree": all(c["outcome"] != "fail" for c in cases),
    }


REFERENCE_CALIBRATION = BUNDLED / "cpu-2core-1ms-poll.json"


def run_validation(
    device: str = "cpu",
    quick: bool = False,
    timeout_s: float = 120.0,
    catalogue: bool = True,
    on_case: Callable[[str, dict[str, Any] | None], None] | None = None,
    calibration: str | Path | None = None,
) -> dict[str, Any]:
    """``calibration``: the file the timed cases simulate with (default: the 2-core VM's in calibrations/; their
    delays sit far enough on either side of an exit for any host's)."""
    from sim.calibration import load as load_calibration

    timing = load_calibration(calibration or REFERENCE_CALIBRATION)
    started = time.perf_counter()
    out: dict[str, Any] = {
        "device": device,
        "profile": predicted_profile(device),
        "quick": quick,
        "calibration": str(calibration or REFERENCE_CALIBRATION),
    }
    if catalogue:
        if on_case:
            on_case("NIXL behaviour catalogue", None)
        out["conformance"] = conformance(device)
        if on_case:
            on_case("NIXL behaviour catalogue", out["conformance"])
    cases, skipped = [], []
    from .deep_ep_probe import unavailable

    no_deep_ep = unavailable() if device == "cuda" else "DeepEP runs on GPUs"
    for case in (c for c in CASES if (c.quick or not quick) and c.device in (None, device)):
        if case.deep_ep and no_deep_ep:
            skipped.append({"case": case.name, "reason": no_deep_ep})
            continue
        if on_case:
            on_case(case.name, None)
        row = run_case(case, device, timeout_s, timing)
        cases.append(row)
        if on_case:
            on_case(case.name, row)
    out["cases"] = cases
    if skipped:
        out["skipped"] = skipped
    out["agree"] = all(c["agree"] for c in cases) and out.get("conformance", {}).get("agree", True)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    return out
