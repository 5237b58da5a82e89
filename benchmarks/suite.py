"""``epsim bench``: every figure of the benchmark issue, each a ratio against a baseline of the same run or a count,
with its target and whether this run met it."""

from __future__ import annotations

import time
from typing import Any, Callable

TARGETS = {  # figure -> (what is compared, target, met?)
    "kernel_overhead": (
        "kernel waits/s over bare SimPy's (64 and 1,024 processes)",
        ">= 0.5",
        lambda f: min(v["ratio"] for v in f.values()) >= 0.5,
    ),
    "time_acceleration": ("simulated s per wall s, DeepSeek-V3 EP64 hour", ">= 100", lambda f: f["ratio"] >= 100),
    "scaling": ("fitted exponent of wall time against ranks x layers", "<= 1.1", lambda f: f["exponent"] <= 1.1),
    "sweep_throughput": (
        "machinery overhead (1 worker vs plain loop); parallel efficiency (2 workers)",
        "< 0.10; >= 0.85",
        lambda f: f["overhead"] < 0.10 and f["parallel_efficiency"] >= 0.85,
    ),
    "time_to_detect": (
        "median swarm seeds until a broken strategy fails (careful one passes); shrunk faults",
        "<= 20; <= 3",
        lambda f: all(
            v["median"] <= 20 and v["shrunk"] is not None and v["shrunk"]["faults_after"] <= 3 for v in f.values()
        ),
    ),
    "real_transfers": (
        "NIXL READ over a torch copy of the same bytes, 1-64 MiB (host memory; on --device cuda "
        "VRAM against a torch peer copy, target 0.95)",
        ">= 0.8 (cuda: >= 0.95)",
        lambda f: f["min_ratio"] >= (0.95 if f["memory"] == "VRAM" else 0.8),
    ),
}


def _summary(name: str, f: dict[str, Any]) -> str:
    if name == "kernel_overhead":
        return ", ".join(f"{k} procs {v['ratio']}" for k, v in f.items())
    if name == "time_acceleration":
        return f"{f['ratio']}x ({f['sim_time_s']} s in {f['wall_s']} s, {f['scenario']})"
    if name == "scaling":
        return f"{f['exponent']} over EP{f['points'][0]['ranks']}-EP{f['points'][-1]['ranks']}"
    if name == "sweep_throughput":
        ray = f.get("ray_runs_per_s")
        return (
            f"overhead {f['overhead']}, efficiency {f['parallel_efficiency']} ({f['plain_runs_per_s']} / "
            f"{f['local1_runs_per_s']} / {f['local2_runs_per_s']} runs/s plain / 1 / 2 workers"
            + (f", Ray {ray}" if ray else "")
            + ")"
        )
    if name == "time_to_detect":
        return "; ".join(
            f"{k}: median {v['median']}, shrunk to {v['shrunk']['faults_after'] if v['shrunk'] else '?'} faults"
            for k, v in f.items()
        )
    if name == "real_transfers":
        return f"min {f['min_ratio']} (" + ", ".join(f"{k} {v['ratio']}" for k, v in f["sizes"].items()) + ")"
    return str(f)


def run(
    quick: bool = False,
    only: list[str] | None = None,
    on_figure: Callable[[str, dict[str, Any], float], None] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    from real_backends import transfers

    from . import kernel, simulation, sweeps

    figures: dict[str, Callable[[], Any]] = {
        "kernel_overhead": lambda: {
            str(n): kernel.measure(n, it, repeats=3 if quick else 5) for n, it in ((64, 200), (1024, 20))
        },
        "time_acceleration": lambda: simulation.time_acceleration(quick),
        "scaling": lambda: simulation.scaling(quick),
        "sweep_throughput": lambda: sweeps.throughput(quick),
        "time_to_detect": lambda: sweeps.time_to_detect(quick),
        "real_transfers": lambda: transfers.measure(repeats=7 if quick else 15, device=device),
    }
    out: dict[str, Any] = {"quick": quick}
    for name, measure in figures.items():
        if only and name not in only:
            continue
        started = time.perf_counter()
        try:
            value = measure()
        except Exception as exc:  # noqa: BLE001 - a figure that cannot be measured here says why
            value = {"error": f"{type(exc).__name__}: {exc}"}
        what, target, check = TARGETS[name]
        met = None if "error" in value else bool(check(value))
        out[name] = {**value, "target": target, "met": met}
        if on_figure is not None:
            on_figure(name, out[name], time.perf_counter() - started)
    return out


def line(name: str, figure: dict[str, Any]) -> tuple[str, str, str, str]:
    what, target, _ = TARGETS[name]
    measured = (
        figure["error"]
        if "error" in figure
        else _summary(name, {k: v for k, v in figure.items() if k not in ("target", "met")})
    )
    met = "n/a" if figure["met"] is None else ("yes" if figure["met"] else "NO")
    return name, measured, target, met
