"""The event history of a run: what happened, when, to whom; its hash; and exports (JSON lines, Perfetto).

A record is ``(t, kind, fields)`` with fields made of plain data only (names, numbers, strings), so that the
history, and therefore its trace hash, is the same in every process for the same seed.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from collections.abc import Sequence
from typing import Any, Callable, Iterable, Iterator

from . import events
from .errors import InternalError


class Records(Sequence):
    """The records as ``(t, kind, fields)`` tuples, kept in three parallel lists.

    A tuple holding a dict stays tracked by Python's cycle collector for ever, so a million of them made every
    planned ``gc.collect()`` of a DeepSeek-scale run traverse them all (about a second each); three lists of
    floats, strings and (untracked, plain) dicts cost it three objects.
    """

    def __init__(self) -> None:
        self._t: list[float] = []
        self._kind: list[str] = []
        self._fields: list[dict[str, Any]] = []

    def append(self, t: float, kind: str, fields: dict[str, Any]) -> None:
        self._t.append(t)
        self._kind.append(kind)
        self._fields.append(fields)

    def __len__(self) -> int:
        return len(self._t)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(zip(self._t[i], self._kind[i], self._fields[i]))
        return self._t[i], self._kind[i], self._fields[i]

    def __iter__(self) -> Iterator[tuple[float, str, dict[str, Any]]]:
        return zip(self._t, self._kind, self._fields)

    def positions(self, kind: str) -> list[int]:
        """The index of every record of ``kind``, in order (one C-level scan per hit, not a Python loop over a
        million records)."""
        found: list[int] = []
        kinds, i = self._kind, -1
        while True:
            try:
                i = kinds.index(kind, i + 1)
            except ValueError:
                return found
            found.append(i)

    def chunks(self, size: int) -> Iterator[tuple[list[float], list[str], list[dict[str, Any]]]]:
        """(times, kinds, fields) of ``size`` records at a time, in order: what the trace hash writes."""
        for i in range(0, len(self._t), size):
            yield self._t[i : i + size], self._kind[i : i + size], self._fields[i : i + size]


ENGINE_TRACK = 1  # the Perfetto process track of records that belong to no simulated process (the engine's)


class History:
    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self.records = Records()
        self.closed = False
        self.malformed: list[str] = []
        # With EPSIM_CHECK_EVENTS=1 (the test suite) every record is checked against its kind (sim/events.py) and
        # what is not one is kept in `malformed`, for the run's end to report: a record is never refused mid-run,
        # where the error would land in the code under test's thread and read as its crash.  The checked methods
        # replace the plain ones here, so that an unchecked run's two records per transfer pay nothing for it.
        if events.checking():
            self.record = self._record_checked  # type: ignore[method-assign]  # chosen once per history
            self.add = self._add_checked  # type: ignore[method-assign]

    def record(self, kind: str, **fields: Any) -> None:
        if not self.closed:
            self.records.append(self._now(), kind, fields)

    def add(self, kind: str, fields: dict[str, Any]) -> None:
        """:meth:`record` with the fields as a dict the history now owns (no keyword repacking: two records per
        transfer)."""
        if not self.closed:
            self.records.append(self._now(), kind, fields)

    def _record_checked(self, kind: str, **fields: Any) -> None:
        self._add_checked(kind, fields)

    def _add_checked(self, kind: str, fields: dict[str, Any]) -> None:
        if self.closed:
            return
        try:
            events.check(kind, fields)
        except events.UnknownEvent as exc:
            if len(self.malformed) < 5:
                self.malformed.append(str(exc))
        self.records.append(self._now(), kind, fields)

    def refuse_malformed(self) -> None:
        """Raise :class:`~sim.errors.InternalError` if a record was not its kind's (checked runs only)."""
        if self.malformed:
            raise InternalError("the history got records sim/events.py does not describe: " + "; ".join(self.malformed))

    def __len__(self) -> int:
        return len(self.records)

    def now(self) -> float:
        return self._now()

    def lines(self) -> Iterable[str]:
        for t, kind, fields in self.records:
            yield json.dumps({"t": round(t, 9), "kind": kind, **fields}, sort_keys=True, default=str)

    def trace_hash(self) -> str:
        """SHA-256 over every record in order, fields in the order they were recorded (the code that records them
        fixes that order), each slice of records written as pickle protocol 5 in fast mode.  Without a memo, the
        bytes depend on values only, not on which objects happen to be shared, so a change that only shares or
        copies objects keeps every hash; plain data and floats pickle to the same bytes in every process.  The
        million records of the EP64 hour hash in about 0.5 s this way, where ``repr`` of every record took 4 s."""
        h = hashlib.sha256()
        for chunk in self.records.chunks(8192):
            buf = io.BytesIO()
            pickler = pickle.Pickler(buf, protocol=5)
            # No memo (see above; records are plain data, never self-referential).  The docs call this switch
            # deprecated, yet it is the only one there is; if it ever goes, setting it raises and the tests say so.
            pickler.fast = True
            pickler.dump(chunk)
            h.update(buf.getbuffer())
        return h.hexdigest()[:16]

    def select(self, *kinds: str) -> list[tuple[float, str, dict[str, Any]]]:
        return [r for r in self.records if r[1] in kinds]

    def write_jsonl(self, path) -> None:
        with open(path, "w") as out:
            for line in self.lines():
                out.write(line + "\n")

    def write_perfetto(self, path, spans=()) -> None:
        """Chrome trace-event JSON (opens in ui.perfetto.dev): a named track per simulated process (pid ``p`` is
        trace pid ``p + 2``: Perfetto treats pid 0 specially) and one for the engine (trace pid 1), a thread track
        per named simulated thread, every record an instant event; ``spans`` (what, start s, end s: rebalances and
        reconfigurations) become slices on the engine's lifecycle track."""
        events: list[dict[str, Any]] = []
        names: dict[int, str] = {ENGINE_TRACK: "engine"}
        tids: dict[tuple[int, str], int] = {(ENGINE_TRACK, "lifecycle"): 1}
        for t, kind, fields in self.records:
            pid = fields.get("pid")
            track = pid + 2 if isinstance(pid, int) and not isinstance(pid, bool) and pid >= 0 else ENGINE_TRACK
            names.setdefault(track, f"pid {pid}")
            thread = fields.get("thread")
            tid = tids.setdefault((track, thread), len(tids) + 1) if isinstance(thread, str) else 0
            events.append(
                {
                    "name": kind,
                    "ph": "i",
                    "s": "t",
                    "ts": t * 1e6,
                    "pid": track,
                    "tid": tid,
                    "args": {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in fields.items()},
                }
            )
        for what, start, end in spans:
            events.append(
                {
                    "name": what,
                    "ph": "X",
                    "ts": start * 1e6,
                    "dur": max(0.0, end - start) * 1e6,
                    "pid": ENGINE_TRACK,
                    "tid": 1,
                }
            )
        meta = [
            {"name": "process_name", "ph": "M", "pid": track, "tid": 0, "args": {"name": name}}
            for track, name in sorted(names.items())
        ]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": track, "tid": tid, "args": {"name": thread}}
            for (track, thread), tid in tids.items()
        ]
        with open(path, "w") as out:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, out)
