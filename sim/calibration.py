"""A timing calibration: what the real backend measured, in the form the simulation's time model takes.

``epsim calibrate`` writes one (JSON); ``epsim run --calibration FILE`` runs the simulation with its numbers instead
of the defaults: a READ alone takes ``xfer_latency_s + bytes / bandwidth_Bps`` (bytes at the scenario's nominal
expert size; the READs one process posts together share ``bandwidth_Bps``), the first one towards a peer
``connect_s`` more, a collective completes ``collective_latency_s`` after its last member arrives, and a planned
collection (COMMIT's, exit's) holds its process ``collect_s``.  The other fields say where and how it was measured;
``process_start_s`` is informational (the simulation has no process start-up: an elastic event's ``prepare_s``
stands for everything PREPARE does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ScenarioError, validation_line


class HostLoad(BaseModel):
    """The costs measured with ``ranks`` processes loaded as ranks on one host at once (real_backends/host_load.py):
    on a host with fewer cores than busy threads each grows with the number of rank processes."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    ranks: int = Field(ge=1, description="rank processes on the host while these were measured")
    xfer_latency_s: float = Field(ge=0, description="a READ's fixed cost, overlapped by the READs posted together")
    post_s: float = Field(0.0, ge=0, description="a READ's own host cost, taking turns on its initiator's link")
    bandwidth_Bps: float = Field(gt=0, description="bytes per second of one process's READs")
    connect_s: float = Field(0.0, ge=0, description="the first READ towards a peer, on top")
    collective_s: float = Field(0.0, ge=0, description="an all_reduce of a few bytes among the ranks")
    first_agent_s: float = Field(0.0, ge=0, description="a process's first agent (UCX loads its transports)")
    agent_s: float = Field(0.0, ge=0, description="each later agent of the process")
    register_s: float = Field(0.0, ge=0, description="one register_memory call")
    group_s: float = Field(0.0, ge=0, description="opening a new group's connections, every member there")
    first_remote_setup_s: float = Field(0.0, ge=0, description="an agent's first add_remote_agent")
    remote_setup_s: float = Field(0.0, ge=0, description="each later add_remote_agent of the agent")
    collect_s: float = Field(0.0, ge=0, description="a full gc.collect() while every rank collects")
    gather_s: float = Field(
        0.0,
        ge=0,
        description="an all_gather_object of an agent's metadata (pickling, two collectives): every object collective",
    )
    barrier_s: float | None = Field(
        None, ge=0, description="a round's barrier, last arrival to first result; informational"
    )
    cold_collective_s: float | None = Field(None, ge=0, description="an all_reduce after 20 ms idle; informational")
    stall_s: float = Field(
        0.0,
        ge=0,
        description=(
            "fitted, not measured alone: what each collective of a rebalance costs on top of collective_s when the "
            "ranks' READs, copies and events share the host (the wait for a rank the scheduler set aside)"
        ),
    )
    command_s: float = Field(0.0, ge=0, description="between the arrivals of a command sent to each rank in turn")
    teardown_s: float = Field(0.0, ge=0, description="a rank process's end after its last collection at exit")
    copy_latency_s: float = Field(0.0, ge=0, description="a row copy in host memory, fixed cost")
    copy_Bps: float | None = Field(None, gt=0, description="bytes per second of a row copy in host memory")
    rounds: list[list[float]] = Field(
        default_factory=list, description="(READs, bytes each, seconds) of the layer-like rounds the transfer fit used"
    )


# The costs a HostLoad row gives the simulation, by name (interpolated between measured rank counts).
LOAD_COSTS = (
    "xfer_latency_s",
    "post_s",
    "connect_s",
    "collective_s",
    "gather_s",
    "first_agent_s",
    "agent_s",
    "register_s",
    "first_remote_setup_s",
    "remote_setup_s",
    "collect_s",
    "seconds_per_byte",
    "copy_latency_s",
    "copy_seconds_per_byte",
    "command_s",
    "teardown_s",
    "stall_s",
    "group_s",
)


class Calibration(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # an infinite READ time would never finish

    xfer_latency_s: float = Field(ge=0, description="fixed cost of one READ (post to DONE), seconds")
    bandwidth_Bps: float = Field(gt=0, description="bytes per second of one READ beyond its fixed cost")
    collective_latency_s: float = Field(0.0, ge=0, description="an all_reduce of a few bytes, seconds")
    connect_s: float = Field(
        0.0,
        ge=0,
        description="what the first READ towards a peer costs on top: loading its "
        "metadata and wiring the endpoint up, seconds",
    )
    process_start_s: float | None = Field(None, ge=0, description="a rank process until it can take commands")
    collect_s: float = Field(
        0.0,
        ge=0,
        description="a planned gc.collect() in a process loaded as a rank is (torch, "
        "NIXL, epsim): the simulation's planned collections take it",
    )
    concurrent_share: float | None = Field(
        None,
        gt=0,
        description=(
            "k READs of one process posted together over k single READs: 1 when they share its bandwidth (the "
            "simulation's model), 1/k when each has all of it; informational"
        ),
    )
    device: str = "cpu"
    memory: str = "DRAM"
    nixl: str = ""
    host: str = ""
    measured_at: str = ""
    points: list[dict[str, float]] = Field(default_factory=list, description="(bytes, seconds) the fit used")
    quick: bool = Field(
        False,
        description="measured with `epsim calibrate --quick`: three sizes and a few repeats, "
        "a check that the path works rather than numbers to trust",
    )
    progress_delay_us: int = Field(
        0,
        ge=0,
        description="the rank processes' NIXL progress-thread poll timeout while measured (0: vLLM's busy loop)",
    )
    fitted_on: str = Field("", description="the real run each row's stall_s was fitted on (judge on others)")
    loaded: list[HostLoad] = Field(
        default_factory=list,
        description=(
            "the costs with 2, 3, ... rank processes on the host; when present the simulation charges each cost at the "
            "number of rank processes alive at the time, and the fields above are not used"
        ),
    )

    def costs(self, ranks: int) -> dict[str, float]:
        """Every cost of :data:`LOAD_COSTS` with ``ranks`` rank processes alive: a measured row, linear between two
        measured rank counts and along the last two beyond them (never below zero); the nearest row below the
        first.  Bandwidth goes as seconds per byte, which grows with the processes sharing the cores."""
        rows = sorted(self.loaded, key=lambda r: r.ranks)
        if not rows:  # the two-process numbers; every other cost is none
            return {
                **dict.fromkeys(LOAD_COSTS, 0.0),
                "xfer_latency_s": self.xfer_latency_s,
                "connect_s": self.connect_s,
                "collective_s": self.collective_latency_s,
                "gather_s": self.collective_latency_s,
                "collect_s": self.collect_s,
                "seconds_per_byte": 1.0 / self.bandwidth_Bps,
            }

        def value(row: HostLoad, key: str) -> float:
            if key == "seconds_per_byte":
                return 1.0 / row.bandwidth_Bps
            if key == "copy_seconds_per_byte":
                return 1.0 / row.copy_Bps if row.copy_Bps else 0.0
            return float(getattr(row, key))

        if len(rows) == 1 or ranks <= rows[0].ranks:
            return {key: value(rows[0], key) for key in LOAD_COSTS}
        lo, hi = rows[-2], rows[-1]
        for a, b in zip(rows, rows[1:]):
            if ranks <= b.ranks:
                lo, hi = a, b
                break
        f = (ranks - lo.ranks) / (hi.ranks - lo.ranks)
        out = {key: max(0.0, value(lo, key) + f * (value(hi, key) - value(lo, key))) for key in LOAD_COSTS}
        out["seconds_per_byte"] = max(out["seconds_per_byte"], 1e-15)
        return out


# Calibrations measured on named hosts, shipped with epsim: `--calibration NAME` takes sim/calibrations/NAME.json.
BUNDLED = Path(__file__).resolve().parent / "calibrations"


def bundled() -> list[str]:
    """The names of the calibrations shipped in :data:`BUNDLED`."""
    return sorted(p.stem for p in BUNDLED.glob("*.json"))


def load(path: str | Path) -> Calibration:
    """The calibration in ``path`` (or the shipped one of that name); one line naming the file and the problem
    otherwise."""
    if not str(path).strip():
        raise ScenarioError("--calibration: an empty path; give the JSON file `epsim calibrate --out` wrote")
    p = Path(path)
    if not p.exists() and "/" not in str(path) and (BUNDLED / f"{path}.json").is_file():
        p = BUNDLED / f"{path}.json"
    if p.exists() and not p.is_dir() and not p.is_file():
        # A device or a pipe would be read until memory runs out, or for ever.
        raise ScenarioError(f"calibration {p}: not a regular file; give the JSON file `epsim calibrate --out` wrote")
    try:
        data: Any = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ScenarioError(
            f"calibration {p}: no such file (write one with `epsim calibrate --out {p}`, or name a "
            f"shipped one: {', '.join(bundled()) or 'none'})"
        ) from None
    except IsADirectoryError:
        raise ScenarioError(
            f"calibration {p}: that is a directory; give the JSON file `epsim calibrate --out` wrote"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ScenarioError(f"calibration {p}: not a JSON file ({exc})") from None
    except RecursionError:
        raise ScenarioError(f"calibration {p}: nested too deeply to be a calibration") from None
    try:
        return Calibration.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(f"calibration {p}: {validation_line(exc)}") from None


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of ``seconds = latency + bytes / bandwidth`` over (bytes, seconds) points, by least
    squares on the *relative* error: sizes span three orders of magnitude, and a plain fit would let the largest
    transfers decide the latency (often negative)."""
    if len(points) < 2:
        raise ValueError("a fit needs two sizes or more")
    # minimise sum(((a + n*s) - t)^2 / t^2): the weighted normal equations of a line through (n, t), weights 1/t^2
    w = [1.0 / (t * t) for _, t in points]
    sw = sum(w)
    sn = sum(wi * n for wi, (n, _) in zip(w, points))
    st = sum(wi * t for wi, (_, t) in zip(w, points))
    snn = sum(wi * n * n for wi, (n, _) in zip(w, points))
    snt = sum(wi * n * t for wi, (n, t) in zip(w, points))
    det = sw * snn - sn * sn
    slope = (sw * snt - sn * st) / det
    latency = (st - slope * sn) / sw
    slope = max(slope, 1e-15)
    if latency < 0:  # no fixed cost visible at these sizes: the line through the origin
        latency, slope = 0.0, snt / snn
    return latency, 1.0 / slope
