"""Time acceleration (simulated seconds per wall second) and scaling (wall time against ranks x layers)."""

from __future__ import annotations

import math
from typing import Any


def _run(sc) -> Any:
    from sim.run import run_scenario

    return run_scenario(sc)


def time_acceleration(quick: bool = False) -> dict[str, Any]:
    """``deepseek-v3-ep64``: one simulated hour, EPLB every 3,000 steps, four elastic events.  ``quick``: the
    first 15,000 steps (12.5 simulated minutes) of it, with its first elastic event."""
    from sim import scenario as scenario_mod

    sc = scenario_mod.load("deepseek-v3-ep64")
    label = sc.name
    if quick:
        sc = scenario_mod.with_overrides(sc, steps=15_000, timeline=[sc.timeline[0].model_dump()])
        label += " (first 15,000 steps)"
    r = _run(sc)
    return {
        "scenario": label,
        "sim_time_s": round(r.sim_time_s, 1),
        "wall_s": r.wall_s,
        "events": r.events,
        "transfers": r.metrics.get("transfers", 0),
        "verdict": r.verdict,
        "trace_hash": r.trace_hash,
        "ratio": round(r.sim_time_s / r.wall_s, 1),
    }


def shape(ranks: int, layers: int = 8):
    """The scaling shape at ``ranks``: DeepSeek-like per rank (4 logical experts and 5 slots per rank, top-8,
    async EPLB every 3,000 steps), 6,000 steps and one scale-up by an eighth of the ranks at step 4,000."""
    from sim import scenario as scenario_mod

    grow = ranks + max(1, ranks // 8)
    data = {
        "name": f"scaling-ep{ranks}",
        "ranks": ranks,
        "max_ranks": grow,
        "model": {
            "layers": layers,
            "experts": 4 * ranks,
            "local_experts": 5,
            "hidden": 4,
            "tensors_per_layer": 4,
            "nominal_expert_bytes": 44040192,
        },
        "eplb": {"step_interval": 3000, "window": 1000, "use_async": True},
        "serving": {"step_time_s": 0.05, "tokens_per_step": 256, "top_k": 8, "skew": 1.2},
        "timeline": [{"at_step": 4000, "kind": "scale_up", "to": grow, "prepare_s": 20.0}],
        "steps": 6000,
    }
    return scenario_mod.from_dict(data, f"scaling shape at EP{ranks}")


def scaling(quick: bool = False, layers: int = 8) -> dict[str, Any]:
    ranks_list = (8, 16, 32, 64) if quick else (8, 16, 32, 64, 128, 256)
    _run(shape(ranks_list[0], layers))  # warm: the first run in a process imports what the others reuse
    points = []
    for ranks in ranks_list:
        r = _run(shape(ranks, layers))
        points.append(
            {
                "ranks": ranks,
                "layers": layers,
                "wall_s": r.wall_s,
                "events": r.events,
                "transfers": r.metrics.get("transfers", 0),
                "verdict": r.verdict,
            }
        )
    xs = [math.log(p["ranks"] * p["layers"]) for p in points]
    ys = [math.log(p["wall_s"]) for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"points": points, "exponent": round(slope, 3)}
