"""Swarm mode: each seed arms its own random subset of fault sites, with random parameters.

As in FoundationDB's BUGGIFY, activation is decided per run: a site is either armed for the whole run or not at all,
so that different seeds explore different combinations instead of every run carrying every fault at a low rate.
The draw depends on the seed and the scenario's shape only, and what it armed is stored as ordinary fault strings:
a swarm run is replayed (and shrunk) as a run with those faults given on the command line.

Only faults that a correct strategy is expected to survive are drawn.  A transfer that never completes, a
registration that fails or an endpoint that is cut fails every strategy by design; those are for targeted runs
with ``--fault``.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import faults as catalogue
from ..rng import Streams

ACTIVATION = 0.3  # chance that a site is armed in a run

# site -> its parameters, drawn from the run's swarm stream (plus rank, at_step and times for every site)
_PARAMS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "gc.late": lambda s: {"delay_s": s.choice([0.5, 2.0, 10.0, 60.0])},
    "gc.cycle": lambda s: {},
    "gc.thread": lambda s: {},
    "gc.never": lambda s: {},
    "storage.move": lambda s: {},
    "peer.restart": lambda s: {},
    "nixl.xfer.late": lambda s: {"delay": s.choice([0.01, 0.5, 5.0])},
    "nixl.notif.delay": lambda s: {"delay": s.choice([0.01, 0.5, 5.0])},
}
SITES = tuple(_PARAMS)


def draw(scenario, seed: int) -> list[catalogue.Armed]:
    """The faults seed ``seed`` arms on ``scenario`` in swarm mode (possibly none)."""
    stream = Streams(seed).get("swarm")
    armed = []
    for site in SITES:
        if not stream.chance(ACTIVATION):
            continue
        params = dict(_PARAMS[site](stream))
        if stream.chance(0.5):  # half the time one rank only, else every rank
            params["rank"] = stream.randint(0, scenario.peak_ranks() - 1)
        if stream.chance(0.5):
            params["at_step"] = stream.randint(0, max(0, scenario.steps - 1))
        if stream.chance(0.5):
            params["times"] = stream.randint(1, 3)
        armed.append(catalogue.validate(site, params))
    return armed
