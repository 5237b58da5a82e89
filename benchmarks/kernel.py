"""Kernel overhead: the greenlet kernel against bare SimPy generator processes on the same synthetic workload.

N processes each sleep ``iterations`` times for a seeded random delay and meet at a barrier every ``barrier_every``
sleeps.  Bare SimPy writes each process as a generator; the kernel runs each as a greenlet of ordinary synchronous
code (``kernel.sleep``, ``kernel.wait``), with its seeded tie-breaks and its history on, as a run has them.  Both
do the same number of waits; the figure is the kernel's waits per second over SimPy's.
"""

from __future__ import annotations

import gc
import random
import time
from typing import Any

import simpy


def _delays(n: int, iterations: int, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    return [[rng.uniform(0.5e-3, 1.5e-3) for _ in range(iterations)] for _ in range(n)]


class _Barrier:
    def __init__(self, env: simpy.Environment, parties: int) -> None:
        self.env, self.parties, self.count = env, parties, 0
        self.event = env.event()

    def arrive(self) -> simpy.Event:
        event = self.event
        self.count += 1
        if self.count == self.parties:
            self.count, self.event = 0, self.env.event()
            event.succeed()
        return event


def bare_simpy(n: int, iterations: int, barrier_every: int, seed: int = 0) -> tuple[int, float]:
    """(waits, wall seconds) of the workload as SimPy generator processes."""
    env = simpy.Environment()
    barrier = _Barrier(env, n)
    delays = _delays(n, iterations, seed)
    waits = [0]

    def proc(mine: list[float]):
        for i, d in enumerate(mine, 1):
            yield env.timeout(d)
            waits[0] += 1
            if i % barrier_every == 0:
                yield barrier.arrive()
                waits[0] += 1

    for mine in delays:
        env.process(proc(mine))
    # The kernel runs with the collector off (Kernel.run, as every simulated run does): so does this side, or the
    # baseline would pay for collections the kernel never makes (19 at 1,024 processes).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        started = time.perf_counter()
        env.run()
        return waits[0], time.perf_counter() - started
    finally:
        if was_enabled:
            gc.enable()


def greenlet_kernel(n: int, iterations: int, barrier_every: int, seed: int = 0) -> tuple[int, float]:
    """(waits, wall seconds) of the same workload as simulated threads of :class:`sim.kernel.Kernel`."""
    from sim.kernel import Kernel

    kernel = Kernel(seed)
    barrier = _Barrier(kernel.env, n)
    delays = _delays(n, iterations, seed)
    waits = [0]

    def thread(mine: list[float]) -> None:
        for i, d in enumerate(mine, 1):
            kernel.sleep(d)
            waits[0] += 1
            if i % barrier_every == 0:
                kernel.wait(barrier.arrive(), "barrier")
                waits[0] += 1

    for pid, mine in enumerate(delays):
        kernel.spawn(f"t{pid}", thread, mine, pid=pid)
    started = time.perf_counter()
    kernel.run()
    return waits[0], time.perf_counter() - started


def measure(n: int, iterations: int, barrier_every: int = 10, repeats: int = 3) -> dict[str, Any]:
    """Best of ``repeats`` for each side (the least disturbed run), interleaved so both see the same machine."""
    best_simpy = best_kernel = float("inf")
    waits = 0
    for _ in range(repeats):
        w1, t1 = bare_simpy(n, iterations, barrier_every)
        w2, t2 = greenlet_kernel(n, iterations, barrier_every)
        assert w1 == w2, (w1, w2)
        waits = w1
        best_simpy, best_kernel = min(best_simpy, t1), min(best_kernel, t2)
    simpy_rate, kernel_rate = waits / best_simpy, waits / best_kernel
    return {
        "processes": n,
        "waits": waits,
        "simpy_waits_per_s": round(simpy_rate),
        "kernel_waits_per_s": round(kernel_rate),
        "ratio": round(kernel_rate / simpy_rate, 3),
    }
