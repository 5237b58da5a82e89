"""An index of byte ranges for "which registered range covers this descriptor?".

EPLB registers hundreds of ranges per agent and looks one up for every descriptor of every transfer, so a linear
scan is the simulator's hot spot.  Ranges are grouped by a key (memory type, device), sorted by start, with a
running maximum of their ends: a query bisects to the last range starting at or before it and walks back only while
an earlier range could still reach the query's end.  Overlapping ranges (legal in NIXL) are handled; the index is
rebuilt lazily after a change, since lookups far outnumber registrations.

Two rules for overlapping ranges.  ``any`` (the oracles' question: is this memory registered at all?) answers with
any range that covers the query.  ``nixl`` is what NIXL 1.5.1 does when it looks a descriptor up in an agent's
registrations (catalogue cases ``overlapping_registrations_*``): it takes the range that starts last at or before
the query (of ranges starting together, the longest) and answers with it only if it covers the whole query, so a
READ in the part of an outer registration past a nested one is NOT_FOUND although the outer one holds it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from typing import Any, Hashable, Iterable, Sequence

_MAX_LIST_ANSWERS = 1 << 16  # whole-list answers kept between changes


class SpanIndex:
    def __init__(self, rule: str = "any") -> None:
        if rule not in ("any", "nixl"):
            raise ValueError(f"rule {rule!r}: 'any' or 'nixl'")
        self._nixl = rule == "nixl"
        self._items: list[tuple[Hashable, int, int, Any]] = []  # (key, start, end, payload)
        self._count: Counter = Counter()
        self._groups: dict[Hashable, tuple[list[int], list[tuple[int, int, Any]], list[int]]] | None = None
        # Answers since the last change: EPLB asks about the same few hundred ranges layer after layer.
        self._answers: dict[tuple[Hashable, int, int], Any] = {}
        # Whole-list answers: a READ's descriptor lists and the spans its completion checks repeat layer after layer,
        # so each is one lookup (the list as a tuple, hashed in C) instead of one per descriptor.  Keyed by memory
        # type (or range key), then the list itself: every tuple a key adds stays tracked by Python's collector
        # until its next pass, and a planned gc.collect() of a DeepSeek-scale run pays for each.
        self._list_answers: dict[int, dict[tuple, tuple]] = {}
        self._uncovered: dict[Hashable, dict[tuple, Any]] = {}

    def add(self, key: Hashable, start: int, length: int, payload: Any) -> None:
        self._items.append((key, start, start + length, payload))
        self._count[payload] += 1
        self._changed()

    def _changed(self) -> None:
        self._groups = None
        self._answers.clear()
        self._list_answers.clear()
        self._uncovered.clear()

    def remove(self, payload: Any) -> bool:
        """Remove one entry whose payload equals ``payload``; False if there is none."""
        for i, item in enumerate(self._items):
            if item[3] == payload:
                del self._items[i]
                self._count[payload] -= 1
                if not self._count[payload]:
                    del self._count[payload]
                self._changed()
                return True
        return False

    def clear(self) -> None:
        self._items.clear()
        self._count.clear()
        self._changed()

    def __contains__(self, payload: Any) -> bool:
        return payload in self._count

    @property
    def members(self) -> Counter:
        """The payloads present, for membership tests in a loop (``x in index.members`` is one C-level lookup;
        read-only: change the index through :meth:`add` and :meth:`remove`)."""
        return self._count

    def __len__(self) -> int:
        return len(self._items)

    def payloads(self) -> Iterable[Any]:
        return (item[3] for item in self._items)

    def _build(self) -> dict:
        groups: dict[Hashable, list[tuple[int, int, Any]]] = {}
        for key, start, end, payload in self._items:
            groups.setdefault(key, []).append((start, end, payload))
        built = {}
        for key, entries in groups.items():
            entries.sort(key=lambda e: (e[0], e[1]))
            prefix, best = [], -1
            for _, end, _ in entries:
                best = max(best, end)
                prefix.append(best)
            built[key] = ([e[0] for e in entries], entries, prefix)
        self._groups = built
        return built

    def find(self, key: Hashable, start: int, length: int, skip=None) -> Any:
        """A payload whose range covers [start, start+length) under ``key`` (None if none; ``skip``: payloads to
        pass over)."""
        if skip is None:
            query = (key, start, length)
            try:
                return self._answers[query]
            except KeyError:
                found = self._answers[query] = self._find(key, start, length, None)
                return found
        return self._find(key, start, length, skip)

    def find_each(self, mem: int, triples: Iterable[Sequence[int]], skip=None) -> tuple[Any, ...]:
        """``tuple(find((mem, dev), addr, length, skip) for addr, length, dev in triples)`` in one call (a prepared
        descriptor list looks up every descriptor)."""
        if skip is not None:
            return tuple(self._find((mem, dev), addr, length, skip) for addr, length, dev in triples)
        if type(triples) is not tuple:
            triples = tuple([(addr, length, dev) for addr, length, dev in triples])
        answers = self._list_answers.get(mem)
        if answers is None:
            answers = self._list_answers[mem] = {}
        found = answers.get(triples)
        if found is None:
            if len(answers) >= _MAX_LIST_ANSWERS:  # a caller making ever new lists: stay bounded
                answers.clear()
            find = self._find
            found = answers[triples] = tuple([find((mem, dev), addr, length, None) for addr, length, dev in triples])
        return found

    def first_uncovered(self, key: Hashable, spans: Iterable[Sequence[int]]) -> tuple[int, int] | None:
        """The first ``(start, length)`` of ``spans`` that no range under ``key`` covers; None if all are covered."""
        if type(spans) is not tuple:  # e.g. a real rank's ledger, read back from JSON as lists
            spans = tuple([(start, length) for start, length in spans])
        answers = self._uncovered.get(key)
        if answers is None:
            answers = self._uncovered[key] = {}
        try:
            return answers[spans]
        except KeyError:
            pass
        if len(answers) >= _MAX_LIST_ANSWERS:
            answers.clear()
        missing = None
        for start, length in spans:
            if self._find(key, start, length, None) is None:
                missing = (start, length)
                break
        answers[spans] = missing
        return missing

    def _find(self, key: Hashable, start: int, length: int, skip) -> Any:
        groups = self._groups if self._groups is not None else self._build()
        group = groups.get(key)
        if group is None:
            return None
        starts, entries, prefix = group
        end = start + length
        i = bisect_right(starts, start) - 1  # entries sort by (start, end): of equal starts, the longest is last
        if self._nixl:
            while i >= 0 and skip is not None and entries[i][2] in skip:
                i -= 1
            return entries[i][2] if i >= 0 and entries[i][1] >= end else None
        while i >= 0 and prefix[i] >= end:
            s, e, payload = entries[i]
            if e >= end and (skip is None or payload not in skip):
                return payload
            i -= 1
        return None
