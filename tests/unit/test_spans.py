"""The range index behind every registration lookup of the fake NIXL and of the oracles: against a plain scan.

Its answers are memoized per descriptor and per whole list until the next change, so the property interleaves
changes with repeated queries: a stale memo would answer for a range that is gone, or miss one that came.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fakes.nixl._spans import SpanIndex

KEYS = [(0, 0), (0, 1), (1, 0)]  # (mem, dev)
starts = st.integers(0, 64)
lengths = st.integers(0, 24)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from(KEYS), starts, lengths, st.integers(0, 5)),
        st.tuples(st.just("remove"), st.integers(0, 5)),
        st.tuples(
            st.just("query"), st.sampled_from(KEYS), st.lists(st.tuples(starts, lengths), min_size=1, max_size=4)
        ),
    ),
    max_size=40,
)


def _covering(items, key, start, length):
    """Every payload whose range covers [start, start+length) under key (a plain scan)."""
    return {p for k, s, e, p in items if k == key and s <= start and start + length <= e}


def _replay(index: SpanIndex, script):
    """Apply the script's changes to ``index`` and to a plain list of (key, start, end, payload); yield at each
    query: (the list now, the query's key, its spans)."""
    items: list = []
    for op in script:
        if op[0] == "add":
            _, key, start, length, payload = op
            index.add(key, start, length, payload)
            items.append((key, start, start + length, payload))
        elif op[0] == "remove":
            payload = op[1]
            present = any(p == payload for *_, p in items)
            assert index.remove(payload) == present
            if present:
                del items[next(i for i, it in enumerate(items) if it[3] == payload)]
        else:
            yield items, op[1], op[2]


@settings(max_examples=300, deadline=None)
@given(ops)
def test_answers_match_a_scan_across_changes(script):
    index = SpanIndex()
    for items, (mem, dev), spans in _replay(index, script):
        for _ in range(2):  # the second time from the memo
            triples = tuple((start, length, dev) for start, length in spans)
            found = index.find_each(mem, triples)
            assert len(found) == len(spans)
            for (start, length), payload in zip(spans, found):
                covering = _covering(items, (mem, dev), start, length)
                assert (payload in covering) if covering else payload is None
            missing = index.first_uncovered((mem, dev), tuple(spans))
            expected = next(((s, n) for s, n in spans if not _covering(items, (mem, dev), s, n)), None)
            assert missing == expected


def test_a_list_answer_is_forgotten_when_a_range_goes():
    index = SpanIndex()
    index.add((0, 0), 100, 50, "a")
    triples = ((110, 10, 0), (120, 10, 0))
    assert index.find_each(0, triples) == ("a", "a")
    assert index.first_uncovered((0, 0), ((110, 10), (120, 10))) is None
    index.remove("a")
    assert index.find_each(0, triples) == (None, None)
    assert index.first_uncovered((0, 0), ((110, 10), (120, 10))) == (110, 10)


def test_lists_of_lists_are_answered_too():
    """A real rank's ledger comes back from JSON with its spans as lists: answered as the tuples would be."""
    index = SpanIndex()
    index.add((0, 0), 100, 50, "a")
    assert index.first_uncovered((0, 0), [[110, 10], [140, 20]]) == (140, 20)
    assert index.first_uncovered((0, 0), [[110, 10]]) is None
    assert index.find_each(0, [[110, 10, 0], [140, 20, 0]]) == ("a", None)


def _nixl_answer(items, key, start, length):
    """NIXL 1.5.1's lookup, by a plain scan: of the ranges under key starting at or before start, the one starting
    last (of those, the longest), if it holds all of [start, start+length); the payload of some such range, or None."""
    before = [(s, e, p) for k, s, e, p in items if k == key and s <= start]
    if not before:
        return None
    s, e = max((s, e) for s, e, _ in before)
    if e < start + length:
        return None
    return {p for s2, e2, p in before if (s2, e2) == (s, e)}


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_nixl_rule_takes_the_range_that_starts_last(script):
    index = SpanIndex("nixl")
    for items, key, spans in _replay(index, script):
        for start, length in spans:
            want = _nixl_answer(items, key, start, length)
            got = index.find(key, start, length)
            assert (got is None) if want is None else (got in want), (items, key, start, length, got)


def test_the_two_rules_differ_past_a_nested_range():
    for rule, want in (("any", "outer"), ("nixl", None)):
        index = SpanIndex(rule)
        index.add(0, 0, 100, "outer")
        index.add(0, 20, 10, "inner")
        assert index.find(0, 50, 10) == want
        assert index.find(0, 22, 4) == "inner" and index.find(0, 5, 4) == "outer"
