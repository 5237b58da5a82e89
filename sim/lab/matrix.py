"""The strategy matrix: strategies x profiles x built-in scenarios x GC faults, with a verdict in each cell; then the
DeepEP dimension and the CUDA stream dimension.

``python -m sim.lab.matrix > docs/results.md`` regenerates the document; ``tests/slow/test_matrix.py`` runs the same
matrix in CI and checks both its expectations and that the document is current.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

from ..run import Result, run_scenario
from ..scenario import load, with_overrides

STRATEGIES = ("per-communicator-agent", "arena-registry", "shared-agent")  # epsim's built-in models
# vLLM's own code (the released 0.33.0's files, sim/vllm/), and the same code with the shared-agent change (the
# simplification of vLLM PR #63134, sim/vllm/shared_agent.py); each beside the built-in that models it.
VLLM_STRATEGIES = ("vllm", "vllm+shared-agent")
MODELLED_BY = {"vllm": "per-communicator-agent", "vllm+shared-agent": "shared-agent"}
MATRIX_STRATEGIES = (*STRATEGIES, *VLLM_STRATEGIES)
PROFILES = ("dram", "cuda", "rocm-strict")
SCENARIOS = ("steady", "scale-up", "scale-down", "elastic-cycle", "abort", "rank-failure")
GC_FAULTS = ("", "gc.late:delay_s=2", "gc.cycle", "gc.thread", "gc.never")
# The GC matrix runs the cuda profile with the host in step with the GPU (vLLM without async scheduling): under
# vLLM's defaults every rebalance on CUDA corrupts expert weights (the stream section), which would hide the agent
# lifecycle that the GC faults probe.
GC_PROFILE_OVERRIDES = {"cuda": {"serving.async_scheduling": False}}
SEED = 0
# The other lifecycle revision, where a scenario follows 0.33.0 (abort follows pr-53947 already: 0.33.0's workers
# take no ABORT).
LATER = "pr-53947"

# The DeepEP dimension: all2all backend x NVSHMEM build (rows) against the reconfigurations and faults that
# decide them (columns), with per-communicator-agent (remote setup deferred, so PREPARE makes no collective of the
# new group) on dram so that only the buffers can fail a run.
DEEPEP_STRATEGY, DEEPEP_PROFILE = "per-communicator-agent-deferred", "dram"
DEEPEP_ROWS = (
    ("deepep_low_latency", "stock"),
    ("deepep_low_latency", "elastic"),
    ("deepep_low_latency", "mi355"),
    ("deepep_high_throughput", "stock"),
)
DEEPEP_COLUMNS: tuple[tuple[str, str, tuple[str, ...], dict[str, Any]], ...] = (  # (label, scenario, faults, overrides)
    ("scale-up", "scale-up", (), {}),
    ("scale-down", "scale-down", (), {}),
    ("elastic-cycle", "elastic-cycle", (), {}),
    ("scale-up, cleanup 5 s late", "scale-up", ("all2all.cleanup_late:delay_s=5",), {}),
    ("scale-up, rank 1's LL parity skewed", "scale-up", ("all2all.parity_skew:rank=1,times=1",), {}),
    ("scale-up, rank 0 combines with a stale handle", "scale-up", ("all2all.stale_handle:rank=0,times=1",), {}),
    (
        "scale-up, explicitly_destroy=False, rank 1's buffer never collected",
        "scale-up",
        ("gc.never:rank=1,what=buffer",),
        {"all2all.explicitly_destroy": False},
    ),
)

# The CUDA stream dimension (sim/device.py): every rank's stream 10 ms behind EPLB's row copies, on the cuda profile,
# for the built-in strategies and for shared-agent with a stream synchronization before each layer's READs (a test
# strategy: `python -m sim.lab.matrix` runs from the repository root, as CI does).
STREAM_FAULT, STREAM_PROFILE = "device.stream_lag:delay_s=0.01", "cuda"
STREAM_SYNCED = "tests.strategies.stream_synced:create"
STREAM_STRATEGIES = (*MATRIX_STRATEGIES, STREAM_SYNCED)


def short(r: Result) -> str:
    """A matrix cell's text: ``pass``, or the verdict and the invariant that broke first."""
    return "pass" if r.verdict == "pass" else f"{r.verdict}: {r.invariant}"


class _Verdict:
    """What every table's cell shares: its run's result, and the text it shows."""

    result: Result

    @property
    def short(self) -> str:
        return short(self.result)


def _table(heads: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a markdown table: its header, the rule under it, a line per row (the three tables here)."""
    return ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads), *("| " + " | ".join(r) + " |" for r in rows)]


def _first_of_each_kind(cells: list, kind: Callable[[Any], Any], label: Callable[[Any], str]) -> list[str]:
    """A line with the oracle's words for the first failing cell of each ``kind``."""
    seen, out = set(), []
    for c in cells:
        if c.result.verdict == "pass" or kind(c) in seen:
            continue
        seen.add(kind(c))
        out.append(f"- **{label(c)}**: {c.result.detail}.")
    return out


@dataclass(frozen=True)
class Cell(_Verdict):
    scenario: str
    strategy: str
    profile: str
    fault: str
    result: Result


def run_matrix(
    scenarios=SCENARIOS, strategies=MATRIX_STRATEGIES, profiles=PROFILES, faults=GC_FAULTS, eplb_async: bool = False
) -> list[Cell]:
    """Every cell's run; ``eplb_async``: with async EPLB (vLLM's default; the built-in scenarios run synchronous)."""
    cells = []
    for name in scenarios:
        sc = load(name)
        if eplb_async:
            sc = with_overrides(sc, **{"eplb.use_async": True})
        for strategy in strategies:
            for profile in profiles:
                psc = with_overrides(sc, **GC_PROFILE_OVERRIDES[profile]) if profile in GC_PROFILE_OVERRIDES else sc
                for fault in faults:
                    r = run_scenario(
                        psc, seed=SEED, strategy=strategy, profile=profile, faults=[fault] if fault else []
                    )
                    cells.append(Cell(name, strategy, profile, fault, r))
    return cells


@dataclass(frozen=True)
class DeepEPCell(_Verdict):
    backend: str
    nvshmem: str
    column: str
    result: Result
    lifecycle: str = "0.33.0"


def run_deep_ep(lifecycles=("0.33.0", LATER)) -> list[DeepEPCell]:
    from ..scenario import with_overrides

    cells = []
    for lifecycle in lifecycles:
        for backend, nvshmem in DEEPEP_ROWS:
            for label, name, faults, extra in DEEPEP_COLUMNS:
                sc = with_overrides(
                    load(name),
                    **{"all2all.backend": backend, "all2all.nvshmem": nvshmem, "lifecycle": lifecycle, **extra},
                )
                r = run_scenario(sc, seed=SEED, strategy=DEEPEP_STRATEGY, profile=DEEPEP_PROFILE, faults=list(faults))
                cells.append(DeepEPCell(backend, nvshmem, label, r, lifecycle))
    return cells


def _deep_ep_table(cells: list[DeepEPCell]) -> list[str]:
    return _table(
        ["backend", "NVSHMEM", *(c[0] for c in DEEPEP_COLUMNS)],
        [
            [backend, nvshmem, *(c.short for c in cells if (c.backend, c.nvshmem) == (backend, nvshmem))]
            for backend, nvshmem in DEEPEP_ROWS
        ],
    )


def _failing_kinds(cells: list[DeepEPCell]) -> list[str]:
    return _first_of_each_kind(
        cells,
        lambda c: (c.result.invariant, (c.result.detail or "").split(":")[-1][:60]),
        lambda c: f"{c.backend} / {c.nvshmem} / {c.column}",
    )


def render_deep_ep(cells: list[DeepEPCell]) -> str:
    released = [c for c in cells if c.lifecycle == "0.33.0"]
    later = [c for c in cells if c.lifecycle == LATER]
    out = [
        "## The DeepEP dimension",
        "",
        f"The workers dispatch and combine one MoE layer through the fake DeepEP `Buffer` at every serving chunk "
        f"and reconfigure as vLLM's managers do; the retired group's manager destroys its buffers on a "
        f"background thread after the switch. When a group's buffer is made depends on the lifecycle revision. "
        f"{DEEPEP_STRATEGY} on {DEEPEP_PROFILE}, seed {SEED}; rows: all2all backend x NVSHMEM build "
        "(`all2all.backend`, `all2all.nvshmem`).",
        "",
        "### vLLM 0.33.0: a group's buffer is made with the MoE kernels that hold it",
        "",
        "At model load, and for the new group at PREPARE (`stage_standby_moe_quant_methods` builds the staged "
        "kernels, whose prepare-and-finalize gets the standby manager's handle: "
        "`model_executor/layers/fused_moe/eep_reconfigure.py`, `all2all_utils.py`), while the old group's "
        "buffer still serves; COMMIT puts the staged kernels in (`_commit_staged_moe_quant_methods`) and the old "
        "buffer loses the MoE layer's reference.",
        "",
    ]
    out += _deep_ep_table(released)
    out += [
        "",
        "What the cells say. Every low-latency cell hangs: the standby buffer initialises NVSHMEM while "
        "the old world's buffer is alive, so its init only bumps the old world's count and keeps the old "
        "size, patch or not, and the new group's first NVSHMEM call waits for ranks that are not in that "
        "world (MI355's build, which refuses a second initialisation after a finalize, hangs the same way, "
        "since nothing was finalized). The elastic patch cannot help under this order: there is no moment "
        "when no buffer is alive. High throughput is as under the other revision (below). Modelled from the "
        "released sources and DeepEP fault 4 of docs/reference/deep-ep.md; not seen on hardware.",
        "",
        "Why the failing cells fail (the first of each kind, in the oracle's words):",
        "",
    ]
    out += _failing_kinds(released)
    out += ["", f"### {LATER}: a group's buffer is made on its first forward step", ""]
    out += _deep_ep_table(later)
    out += [
        "",
        "What the cells say. Low latency runs over NVSHMEM: the new group's buffers are made on its first "
        "forward step, mostly after the cleanup destroyed the old ones, so the count reaches zero first; "
        "stock NVSHMEM then reuses the old world (its size), the elastic patch bootstraps a new one, and "
        "MI355's build refuses to initialise again. The cleanup runs on a background thread while the new "
        "group serves, so the two race: where a rank makes its new buffer before its cleanup destroyed the "
        "old one, the run fails under the patch too. DeepEP's destroy() keeps the GIL while it waits in its "
        "barrier, so a rank's first forward cannot get ahead of a cleanup already in it: the race is lost at "
        "none of seeds 0-23, but a cleanup 5 s late loses it. A late cleanup leaves an old buffer alive, and "
        "the new buffer's init only bumps the old world's count, patch or not. Intranode high throughput "
        "never touches NVSHMEM, but its buffers have no strong reference besides the MoE layer's: the "
        "survivors' old buffers are dropped at the switch and leak (DeepEP warns; the cleanup finds an empty "
        "cache), the first problem of every high-throughput run that reconfigures. Behind it, ranks leaving "
        "at a scale-down destroy theirs collectively alongside the survivors' COMMIT (switch_and_remove) and "
        "wait for peers that never come. This row follows vLLM 0.33.0's managers as read from its sources; on one H100 "
        "with DeepEP v1.2.1 the real backend gave the same leak at scale-up 2->4 and scale-down 4->2, and a "
        "leaving rank's destroy() (at its exit, in the engine's order then) trapped after DeepEP's 100 s "
        "(docs/deep-ep-fake.md). With "
        "`explicitly_destroy=False`, the collector runs the collective destroy, so the rank whose buffer is "
        "never collected is the one the others wait for.",
        "",
        "Why the failing cells fail (the first of each kind, in the oracle's words):",
        "",
    ]
    out += _failing_kinds(later)
    out.append("")
    return "\n".join(out)


@dataclass(frozen=True)
class StreamCell(_Verdict):
    strategy: str
    scenario: str
    result: Result
    mode: str = "defaults"  # the STREAM_MODES entry it ran under


# The stream tables: vLLM's defaults (async scheduling on: a step's forward work is still queued when EPLB runs),
# the same with async EPLB, and the injected lag alone (the host in step with the GPU, so only the fault decides).
STREAM_MODES: tuple[tuple[str, dict[str, Any], list[str]], ...] = (
    ("defaults", {}, []),
    ("defaults, async EPLB", {"eplb.use_async": True}, []),
    ("lag", {"serving.async_scheduling": False}, [STREAM_FAULT]),
)


def run_stream_lag() -> list[StreamCell]:
    return [
        StreamCell(
            strategy,
            name,
            run_scenario(
                with_overrides(load(name), **overrides),
                seed=SEED,
                strategy=strategy,
                profile=STREAM_PROFILE,
                faults=faults,
            ),
            mode,
        )
        for mode, overrides, faults in STREAM_MODES
        for strategy in STREAM_STRATEGIES
        for name in SCENARIOS
    ]


def _stream_table(cells: list[StreamCell]) -> list[str]:
    return _table(
        ["strategy", *SCENARIOS],
        [
            [
                "shared-agent + stream synchronize" if strategy == STREAM_SYNCED else strategy,
                *(c.short for c in cells if c.strategy == strategy),
            ]
            for strategy in STREAM_STRATEGIES
        ],
    )


def _stream_kinds(cells: list[StreamCell]) -> list[str]:
    return _first_of_each_kind(
        cells, lambda c: (c.result.invariant, c.strategy == STREAM_SYNCED), lambda c: f"{c.strategy} / {c.scenario}"
    )


def render_stream_lag(all_cells: list[StreamCell]) -> str:
    mode = {m: [c for c in all_cells if c.mode == m] for m, _, _ in STREAM_MODES}
    out = [
        "## The CUDA stream dimension: the copy/READ race under vLLM's defaults",
        "",
        "EPLB's row copies (the local copies into `expert_buffer`, and `move_from_buffer` out of it) are "
        "`non_blocking` copies on the rank's current CUDA stream, while a NIXL READ is posted from the host and "
        "lands in no order with that stream. vLLM 0.33.0's `NixlEplbCommunicator` synchronizes the stream "
        "before a layer's READs only on ROCm (`set_transfer_context`, `eplb_communicator.py`). With async "
        "scheduling, on by default (`VllmConfig` turns it on unless an option is incompatible: "
        "`config/vllm.py`), `eplb_step` runs at the end of `sample_tokens` before the GPU has run the step "
        "(the bookkeeping does not wait for the sampled tokens: `v1/worker/gpu_model_runner.py`), so EPLB's "
        "copies queue behind that step's forward work. The simulation leaves one step of forward work (50 ms "
        "here) on each rank's stream after every step (`serving.host_ahead_steps`, derived from "
        "`serving.async_scheduling`; `sim/device.py`). No fault is armed in the first two tables; "
        f"{STREAM_PROFILE} profile, seed {SEED}. The last row is shared-agent with "
        f"`torch.cuda.current_stream().synchronize()` before each layer's READs (`{STREAM_SYNCED}`).",
        "",
        "### vLLM's defaults, synchronous EPLB",
        "",
    ]
    out += _stream_table(mode["defaults"])
    out += ["", "### vLLM's defaults, async EPLB (`--set eplb.use_async=true`)", ""]
    out += _stream_table(mode["defaults, async EPLB"])
    out += [
        "",
        "What the cells say. A layer's READs land in `expert_buffer` while the copy of the layer before out "
        "of it still waits behind the forward work, so a row ends up holding another layer's expert. "
        "Synchronous EPLB: the next layer's READs follow the copies with nothing between them. Async EPLB: "
        "the async thread starts the next layer's READs as soon as the main thread has issued the copies and "
        "recorded the consumed event (`CpuGpuEvent` orders the thread's stream after it, not its READs). "
        "Every strategy that does not synchronize fails the weight check wherever it rebalances, vLLM 0.33.0's "
        "own code included; the synchronized variant keeps only shared-agent's own findings. Without async "
        "scheduling (`--set serving.async_scheduling=false`) the bookkeeping waits for the step and these "
        "cells are those of the GC matrix's cuda rows. On GPUs: vLLM 0.33.0's communicator and move loop "
        "corrupted rows on an H100 with about 10 ms of work queued and none with an idle stream; through "
        "epsim's real backend under these defaults, async EPLB failed the weight check in every run, with the "
        "simulation's first wrong row, and the synchronized variant passed (one H100 shared by three ranks; "
        '`docs/vllm.md`, "On a GPU").',
        "",
        "To rerun it: `./dev epsim run scale-up --strategy vllm --profile cuda` (vLLM 0.33.0's communicator "
        "and its own move loop, `rebalance_execute.py`, unmodified: exit 1, `safety: expert_weights`); the shrunk "
        "bundle `tests/corpus/vllm-0.33.0-cuda-copy-read-race` (2 ranks, 2 layers, one step; `./dev epsim replay` "
        "it); on a GPU, `./dev epsim run scale-up --set timeline.0.to=3 --set max_ranks=3 --strategy vllm "
        "--backend real --device cuda`, whose ranks queue one step of forward work (a sleep kernel) after every "
        'step as the simulation does (`docs/vllm.md`, "On a GPU", has the runs).',
        "",
        "Why the failing cells fail (the first of each kind, in the oracle's words):",
        "",
    ]
    out += _stream_kinds(mode["defaults"] + mode["defaults, async EPLB"])
    out += [
        "",
        "### An injected lag alone",
        "",
        f"`{STREAM_FAULT}` with the host in step with the GPU (`serving.async_scheduling=false`): the stream is "
        "10 ms behind each of EPLB's copies for every rebalance, as a busy GPU is.",
        "",
    ]
    out += _stream_table(mode["lag"])
    out += [
        "",
        "What the cells say. The same race from the lag alone: every built-in strategy fails the weight "
        "check in every scenario, whatever its agent lifecycle; the synchronized variant fails only where "
        "shared-agent fails without a lag. On an H200 pair the same lag on scale-up 2->3 gives the "
        "simulation's verdict, and in five runs of six its first wrong row (`docs/validation.md`).",
        "",
        "Why the failing cells fail (the first of each kind, in the oracle's words):",
        "",
    ]
    out += _stream_kinds(mode["lag"])
    out.append("")
    return "\n".join(out)


def why(cell: Cell) -> tuple[str, str]:
    """(cause, example detail) of a failing cell: one sentence on why it fails, and the oracle's words."""
    r = cell.result
    d = r.detail or ""
    if (
        r.invariant == "stale_peer"
        and cell.scenario == "abort"
        and cell.strategy in ("per-communicator-agent", *VLLM_STRATEGIES)
    ):
        cause = (
            "vLLM 0.33.0 loads every peer when it builds a communicator (two all_gather_object in the "
            "constructor): the aborted PREPARE's communicator, kept until the next PREPARE, still has the rank "
            "that was to join loaded after it left"
        )
    elif r.invariant == "stale_peer":
        cause = {
            "arena-registry": "the arena agent outlives the reconfiguration and nothing removes peers while it has "
            "users (its remote-name cache only ever grows), so the departed ranks stay loaded",
            "shared-agent": "the one shared agent outlives every communicator and finalizers release only transfer "
            "handles, so the departed ranks stay loaded",
            "vllm+shared-agent": "the one shared agent outlives every communicator and finalizers release only "
            "transfer handles, so the departed ranks stay loaded",
        }.get(
            cell.strategy,
            "the GC fault keeps the old communicator alive past the reconfiguration, and with it "
            "an agent that still has the departed ranks loaded: its finalizer, which removes them, "
            "has not run yet",
        )
    elif r.invariant == "exception" and "nixlBackendError" in d and "prepare" in d:
        cause = (
            "PREPARE builds a second agent that registers the expert weights the live agent already holds, and "
            "rocm-strict refuses a second registration of the same pages"
        )
    elif r.invariant == "stuck" and cell.scenario == "rank-failure":
        cause = (
            "vLLM has no rank-failure recovery yet (#46370): the engine's next command goes to the dead rank "
            "too, and the engine stops as soon as it sees that rank will never answer"
        )
    else:
        cause = f"{r.verdict} ({r.invariant})"
    return cause, d


def render(cells: list[Cell]) -> str:
    out = [
        "# The strategy matrix",
        "",
        "Generated by `python -m sim.lab.matrix > docs/results.md` (seed 0; `tests/slow/test_matrix.py` runs the",
        "whole matrix in the exhaustive test run, `./dev test --slow`, and fails when this file is stale; the",
        "default run checks a sample of it). Rows: strategy x fake-NIXL profile;",
        "columns: the GC fault armed (`gc.late` with `delay_s=2`). A cell is the run's verdict and, if it is not",
        "`pass`, the invariant that broke first. Per-communicator-agent's duplicate registrations are counted in",
        "the last column (two live agents of one process holding the same pages, on every PREPARE). The",
        "scenarios run synchronous EPLB; with async EPLB (`--set eplb.use_async=true`, vLLM's default: the layers",
        "move on a thread of their own while the group serves, the reshuffle after a scale-up too) every cell",
        "gives the same verdict, which the same test file checks. The cuda rows run with vLLM's async",
        "scheduling off (`serving.async_scheduling=false`, the host in step with the GPU): under vLLM's defaults",
        "every rebalance on CUDA first corrupts expert weights (the CUDA stream section, last), which would hide",
        "what the GC faults do.",
        "",
    ]
    for name in dict.fromkeys(c.scenario for c in cells):
        sc = load(name)
        out += [f"## {name}", "", " ".join(sc.description.split()), ""]
        faults = list(dict.fromkeys(c.fault for c in cells if c.scenario == name))
        rows = []
        for strategy in dict.fromkeys(c.strategy for c in cells):
            for profile in dict.fromkeys(c.profile for c in cells):
                row = [c for c in cells if (c.scenario, c.strategy, c.profile) == (name, strategy, profile)]
                if row:
                    dup = row[0].result.metrics.get("duplicate_registrations", 0)
                    rows.append([strategy, profile, *(c.short for c in row), str(dup)])
        out += _table(["strategy", "profile", *(f or "no fault" for f in faults), "duplicate registrations"], rows)
        out.append("")
    failing = [c for c in cells if c.result.verdict != "pass"]
    out += [
        "## Why each failing cell fails",
        "",
        "Cells with the same cause are listed together (profiles, then the faults under which it fails); the",
        "quoted detail is the oracle's, from the first of them.",
        "",
    ]
    if not failing:
        out.append("Every cell passes.")
    groups: dict[tuple[str, str, str], list[Cell]] = {}
    for c in failing:
        groups.setdefault((c.scenario, c.strategy, why(c)[0]), []).append(c)
    for (scenario, strategy, cause), group in groups.items():
        where = "; ".join(
            f"{p}: " + ", ".join(c.fault or "no fault" for c in group if c.profile == p)
            for p in dict.fromkeys(c.profile for c in group)
        )
        out.append(f"- **{scenario} / {strategy}** ({where}): {cause}. Detail: {why(group[0])[1]}.")
    out.append("")
    return "\n".join(out)


# Why vLLM's code and the built-in that models it differ, where they do (the scenario decides it).
DIFFERENCES = {
    ("vllm+shared-agent", "abort"): "vLLM's class loads every peer when it builds a communicator, and the "
    "shared-agent change keeps that; the built-in shared-agent models a later revision that defers it to the first "
    "transfer, so an aborted PREPARE there leaves nothing loaded",
}


def render_vllm(cells: list[Cell], async_cells: list[Cell] | None = None) -> str:
    """vLLM's code against its models, cell by cell, with a sentence for each kind of difference."""
    from ..vllm import source

    where = source.released()
    out = [
        "## vLLM's own code against the built-in models",
        "",
        f"`vllm` is vLLM {where.version}'s `NixlEplbCommunicator`, built by its own `create_eplb_communicator` "
        f"from the released wheel's files, unmodified (sources digest `{where.digest()}`); `vllm+shared-agent` "
        "is the same class with the change under review applied as a subclass (`sim/vllm/shared_agent.py`). "
        "Each is compared with the built-in that models it, over every cell above:",
        "",
    ]
    for ours, model in MODELLED_BY.items():
        mine = {(c.scenario, c.profile, c.fault): c for c in cells if c.strategy == ours}
        theirs = {(c.scenario, c.profile, c.fault): c for c in cells if c.strategy == model}
        differ = [k for k in mine if k in theirs and mine[k].short != theirs[k].short]
        if not differ:
            out.append(f"- **{ours}** and **{model}** agree on all {len(mine)} cells.")
            continue
        out.append(f"- **{ours}** and **{model}** differ on {len(differ)} of {len(mine)} cells:")
        for scenario in dict.fromkeys(k[0] for k in differ):
            keys = [k for k in differ if k[0] == scenario]
            shown = {(mine[k].short, theirs[k].short) for k in keys}
            said = "; ".join(f"{ours} {a}, {model} {b}" for a, b in sorted(shown))
            reason = DIFFERENCES.get((ours, scenario), "not explained yet")
            out.append(f"  - {scenario} ({len(keys)} cells: {said}): {reason}.")
    out.append("")
    return "\n".join(out)


# The GC dimension under the other revision (one profile shows where they differ).
LIFECYCLE_PROFILE = "dram"

# Why a cell's verdict depends on the lifecycle revision (the fault decides it).
LIFECYCLE_WHY = {
    "gc.cycle": "vLLM 0.33.0 collects garbage again right after the swap (warm_and_capture releases the CUDA "
    "graphs: `gc.collect()` in `elastic_execute.py`), so an old communicator that only a reference cycle keeps is "
    "finalized, and its departed peers removed, before the reconfiguration completes; pr-53947 collects once, "
    "before the swap, and the cycle waits for the process's next planned collection",
}


def run_lifecycle(scenarios=SCENARIOS, strategies=MATRIX_STRATEGIES, faults=GC_FAULTS) -> list[Cell]:
    """The cells of the scenarios that follow 0.33.0, run under the other revision (one profile)."""
    cells = []
    for name in scenarios:
        sc = load(name)
        if sc.lifecycle == LATER:
            continue
        sc = with_overrides(sc, lifecycle=LATER)
        for strategy in strategies:
            for fault in faults:
                r = run_scenario(
                    sc, seed=SEED, strategy=strategy, profile=LIFECYCLE_PROFILE, faults=[fault] if fault else []
                )
                cells.append(Cell(name, strategy, LIFECYCLE_PROFILE, fault, r))
    return cells


def lifecycle_differences(cells: list[Cell], later: list[Cell]) -> list[tuple[Cell, Cell]]:
    """(0.33.0's cell, pr-53947's) wherever the verdicts differ."""
    now = {(c.scenario, c.strategy, c.profile, c.fault): c for c in cells}
    return [
        (now[k], c)
        for c in later
        if (k := (c.scenario, c.strategy, c.profile, c.fault)) in now and now[k].short != c.short
    ]


def render_lifecycle(cells: list[Cell], later: list[Cell]) -> str:
    out = [
        "## The lifecycle revisions",
        "",
        "Every scenario above follows vLLM 0.33.0's worker lifecycle (`lifecycle: 0.33.0`, the default), "
        f"except abort, which needs the revision whose workers take an ABORT (`lifecycle: {LATER}`, vLLM PR "
        "#53947; 0.33.0 has only the external coordinator's abort, which reaches no worker). What each revision "
        "does at each step, with vLLM's files: `docs/simulation.md`. The other scenarios under "
        f"`{LATER}` ({LIFECYCLE_PROFILE}, every strategy and GC fault: {len(later)} cells) differ here:",
        "",
    ]
    differ = lifecycle_differences(cells, later)
    if not differ:
        out.append("- nowhere.")
    groups: dict[tuple[str, str], list[tuple[Cell, Cell]]] = {}
    for ours, theirs in differ:
        groups.setdefault((ours.fault.partition(":")[0], ours.short + " / " + theirs.short), []).append((ours, theirs))
    for (site, shown), pairs in groups.items():
        where = "; ".join(
            f"{sc}: " + ", ".join(o.strategy for o, _ in pairs if o.scenario == sc)
            for sc in dict.fromkeys(o.scenario for o, _ in pairs)
        )
        now, then = shown.split(" / ")
        out.append(
            f"- **{site or 'no fault'}** ({where}): 0.33.0 {now}, {LATER} {then}. "
            f"{LIFECYCLE_WHY.get(site, 'not explained yet')}."
        )
    out.append("")
    return "\n".join(out)


def main() -> int:
    cells = run_matrix()
    sys.stdout.write(
        render(cells)
        + "\n"
        + render_vllm(cells)
        + "\n"
        + render_lifecycle(cells, run_lifecycle())
        + "\n"
        + render_deep_ep(run_deep_ep())
        + "\n"
        + render_stream_lag(run_stream_lag())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
