"""The garbage-collection controller: when a dropped communicator (or buffer) is finalized.

During a run Python's automatic collector is off (the kernel disables it): an object dies when its last reference
goes (refcounting, what CPython does for acyclic garbage) or at a *planned* collection (vLLM's switch_and_prepare
calls ``gc.collect()``; the run's end is another).  The GC faults move a finalization somewhere else in time or onto
another thread, and record where it ran:

- ``gc.late``: the dropped object is kept alive ``delay_s`` longer, then released on a thread of its own process;
- ``gc.cycle``: it is put in a reference cycle, so only its process's next planned collection finalizes it;
- ``gc.thread``: it is released on another simulated thread of the process (the async-EPLB or prepare thread);
- ``gc.never``: it survives until interpreter shutdown, when the fake modules are already torn down.

Every simulated process shares the simulator's one Python heap, so a planned collection is modelled per process:
the cycles the controller made for that process are broken on the collecting thread (their finalizers run there,
in the order they were dropped), and Python's own collector runs once per simulated instant for cycles that the
code under test makes itself.  At EP64 all ranks commit at one instant, and a full collection of the simulator's
heap per rank cost more than the rest of a reconfiguration.
"""

from __future__ import annotations

import gc as _gc
from collections import defaultdict
from typing import Any

from .faults import DROPS


class GcController:
    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.kernel = cluster.kernel
        self._cycles: dict[int, list[list]] = defaultdict(list)  # pid -> self-referencing cells, in drop order
        self._immortal: list[tuple[int, str, Any]] = []
        self._gone: list[Any] = []  # what processes that ended left behind: never finalized inside the run
        self._collected_at: float | None = None  # simulated time of the last real gc.collect()

    def drop(self, pid: int, obj: Any, what: str) -> None:
        """``obj`` just lost its owner's reference (the caller deletes its own name right after)."""
        faults = self.cluster.faults
        if what not in DROPS:  # a GC fault's what= is checked against these names before the run
            raise ValueError(f"drop {what!r} is not in sim.faults.DROPS")
        fault = faults.take_gc(pid, what)
        how = fault.site if fault is not None else "refcount"
        self.kernel.history.record("gc.drop", pid=pid, what=what, how=how)
        if fault is None:
            return  # the caller's `del` is the last reference: finalized right there, on the caller's thread
        if fault.site == "gc.late":
            delay = float(fault.params.get("delay_s", 1.0))
            holder = [obj]
            self.kernel.spawn(f"gc-late@{pid}", self._release_later, holder, delay, pid, what, pid=pid, daemon=True)
        elif fault.site == "gc.cycle":
            cell: list = [obj]
            cell.append(cell)
            self._cycles[pid].append(cell)
        elif fault.site == "gc.thread":
            holder = [obj]
            worker = self.cluster.timeline.workers.get(pid)
            target = worker.other_thread_name() if worker is not None else f"gc@{pid}"
            self.kernel.spawn(target, self._release_later, holder, 0.0, pid, what, pid=pid, daemon=True)
        elif fault.site == "gc.never":
            self._immortal.append((pid, what, obj))

    def _release_later(self, holder: list, delay: float, pid: int, what: str) -> None:
        if delay > 0:
            self.kernel.sleep(delay, "gc.late")
        self.kernel.history.record("gc.finalize", pid=pid, what=what, how="released")
        holder.clear()  # the last reference: the finalizer runs on this thread, now

    def collect(self, reason: str, pid: int | None = None) -> None:
        """A planned collection in process ``pid`` (every process if None): what ``gc.collect()`` there does."""
        # Recorded first: the finalizers this collection runs appear after it in the history.
        self.kernel.history.record("gc.collect", pid=pid, reason=reason)
        pids = list(self._cycles) if pid is None else [pid]
        for p in pids:
            for cell in self._cycles.pop(p, ()):
                cell.clear()  # the cycle is broken: its object's last reference goes, on this thread
        now = self.kernel.now()
        if pid is None or self._collected_at != now:
            self._collected_at = now
            _gc.collect()
        # A calibration says how long a full collection holds a rank's thread; the simulated thread that asked waits
        # that long (the defaults, and the engine's own collections, take none).  It was measured with every process
        # collecting at once, so it is taken at the number of ranks the command that collects went to (COMMIT's
        # committing ranks, exit's departing ones), not at the ranks alive.
        self.cluster.spend(self.cluster.collect_cost(), "gc.collect")

    def process_gone(self, pid: int) -> None:
        """Process ``pid`` exited or was killed: what a GC fault still holds for it (a cycle awaiting a collection,
        an object awaiting interpreter shutdown) went with the process, so its finalizer never runs inside the run
        (it would act for a process that no longer exists).  Kept referenced until the run's world is dropped."""
        self._gone.extend(self._cycles.pop(pid, ()))
        self._gone.extend(entry for entry in self._immortal if entry[0] == pid)
        self._immortal = [entry for entry in self._immortal if entry[0] != pid]

    def shutdown(self) -> list[tuple[int, str, Any]]:
        """What is left for interpreter shutdown (gc.never); the caller finalizes it with the fakes torn down."""
        left, self._immortal = self._immortal, []
        return left
