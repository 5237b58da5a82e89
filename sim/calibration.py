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


class Calibration(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # an infinite READ time would never finish

    xfer_latency_s: float = Field(ge=0, description="fixed cost of one READ (post to DONE), seconds")
    bandwidth_Bps: float = Field(gt=0, description="bytes per second of one READ beyond its fixed cost")
    collective_latency_s: float = Field(0.0, ge=0, description="an all_reduce of a few bytes, seconds")
    connect_s: float = Field(0.0, ge=0, description="what the first READ towards a peer costs on top: loading its "
                                                     "metadata and wiring the endpoint up, seconds")
    process_start_s: float | None = Field(None, ge=0, description="a rank process until it can take commands")
    collect_s: float = Field(0.0, ge=0, description="a planned gc.collect() in a process loaded as a rank is (torch, "
                                                     "NIXL, epsim): the simulation's planned collections take it")
    concurrent_share: float | None = Field(None, gt=0, description=(
        "k READs of one process posted together over k single READs: 1 when they share its bandwidth (the "
        "simulation's model), 1/k when each has all of it; informational"))
    device: str = "cpu"
    memory: str = "DRAM"
    nixl: str = ""
    host: str = ""
    measured_at: str = ""
    points: list[dict[str, float]] = Field(default_factory=list, description="(bytes, seconds) the fit used")
    quick: bool = Field(False, description="measured with `epsim calibrate --quick`: three sizes and a few repeats, "
                                           "a check that the path works rather than numbers to trust")


def load(path: str | Path) -> Calibration:
    """The calibration in ``path``; one line naming the file and the problem otherwise."""
    if not str(path).strip():
        raise ScenarioError("--calibration: an empty path; give the JSON file `epsim calibrate --out` wrote")
    p = Path(path)
    if p.exists() and not p.is_dir() and not p.is_file():
        # A device or a pipe would be read until memory runs out, or for ever.
        raise ScenarioError(f"calibration {p}: not a regular file; give the JSON file `epsim calibrate --out` wrote")
    try:
        data: Any = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ScenarioError(f"calibration {p}: no such file (write one with `epsim calibrate --out {p}`)") from None
    except IsADirectoryError:
        raise ScenarioError(f"calibration {p}: that is a directory; give the JSON file `epsim calibrate --out` "
                            f"wrote") from None
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
