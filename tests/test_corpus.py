"""The regression corpus: every shrunk failure saved in tests/corpus (``epsim shrink BUNDLE --corpus tests/corpus``)
must still fail the same way, with the same trace hash.  A change that alters a history on purpose re-shrinks the
bundle; a change that makes one pass has fixed (or hidden) the bug it records."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.lab import bundle

CORPUS = Path(__file__).parent / "corpus"
BUNDLES = sorted(p for p in CORPUS.iterdir() if (p / "failure.json").is_file()) if CORPUS.is_dir() else []


def test_the_corpus_holds_the_issue_findings() -> None:
    names = {p.name for p in BUNDLES}
    assert {
        "rocm-strict-duplicate-registration",
        "broken-finalizer-gc-late",
        "vllm-0.33.0-cuda-copy-read-race",
    } <= names


@pytest.mark.parametrize("path", BUNDLES, ids=[p.name for p in BUNDLES])
def test_corpus_bundle_replays(path: Path, request) -> None:
    if bundle.load(path).config["strategy"].startswith("vllm"):
        request.getfixturevalue("released")  # vLLM's sources (a skip offline, unless EPSIM_REQUIRE_VLLM=1)
    rep = bundle.replay(path)
    expected = rep.bundle.expected
    assert rep.result.signature == expected["signature"], rep.result.detail
    assert rep.result.trace_hash == expected["trace_hash"], f"history changed; replay with {rep.bundle.data['replay']}"
    c = rep.bundle.config
    assert len(c["faults"]) <= 3 and c["elastic_events"] <= 1  # shrunk


def test_replay_reads_the_tape_and_names_the_first_decision_that_differs(tmp_path) -> None:
    """DESIGN: replay reads the tape.  A bundle's recorded decisions are compared with the replay's; an untouched
    bundle has none that differ, and a changed one is named with its stream and value."""
    import json
    import shutil

    src = Path("tests/corpus/broken-finalizer-gc-late")
    assert bundle.replay(src).tape_divergence() is None
    copy = tmp_path / "b"
    shutil.copytree(src, copy)
    tape = json.loads((copy / "tape.json").read_text())
    drawn = tape["decisions"][1][2]
    tape["decisions"][1][2] = drawn + 1
    (copy / "tape.json").write_text(json.dumps(tape))
    found = bundle.replay(copy).tape_divergence()
    n = len(tape["decisions"])
    assert found == f"decision 2 of {n}: the tape has uuid bits {drawn + 1}, the replay drew uuid bits {drawn}"
    tape["decisions"].append(["uuid", "bits", 1])
    (copy / "tape.json").write_text(json.dumps({"seed": 3, "decisions": tape["decisions"][:1]}))
    assert bundle.replay(copy).tape_divergence() == f"the tape has 1 decisions, the replay made {n}"
