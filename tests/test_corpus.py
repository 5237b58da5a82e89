"""The regression corpus: every shrunk failure saved in tests/corpus (``epsim shrink BUNDLE --corpus tests/corpus``)
must still fail the same way, with the same trace hash.  A change that alters a history on purpose re-shrinks the
bundle; a change that makes one pass has fixed (or hidden) the bug it records."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim import bundle

CORPUS = Path(__file__).parent / "corpus"
BUNDLES = sorted(p for p in CORPUS.iterdir() if (p / "failure.json").is_file()) if CORPUS.is_dir() else []


def test_the_corpus_holds_the_issue_findings() -> None:
    names = {p.name for p in BUNDLES}
    assert {"rocm-strict-duplicate-registration", "broken-finalizer-gc-late"} <= names


@pytest.mark.parametrize("path", BUNDLES, ids=[p.name for p in BUNDLES])
def test_corpus_bundle_replays(path: Path) -> None:
    rep = bundle.replay(path)
    expected = rep.bundle.expected
    assert rep.result.signature == expected["signature"], rep.result.detail
    assert rep.result.trace_hash == expected["trace_hash"], f"history changed; replay with {rep.bundle.data['replay']}"
    c = rep.bundle.config
    assert len(c["faults"]) <= 3 and c["elastic_events"] <= 1  # shrunk
