"""Nothing already written is lost: bundle folders are checked before any run, never removed wholesale, and a
damaged bundle costs one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sim.lab import bundle
from tests.conftest import epsim, epsim_here

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
BUNDLE = CORPUS / "rocm-strict-duplicate-registration"  # a small failing run (a crash at the first PREPARE)


@pytest.fixture
def found(tmp_path: Path) -> Path:
    """A copy of a corpus bundle, as a sweep would have left it."""
    return Path(shutil.copytree(BUNDLE, tmp_path / "found" / BUNDLE.name))


def _one_error_line(done) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("epsim: error: "), done.stderr
    assert not done.stdout.strip()  # refused before any run
    return lines[0]


def test_shrink_refuses_a_folder_of_other_files_and_keeps_them(found: Path, tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("important")
    line = _one_error_line(epsim_here("shrink", str(found), "--out", str(precious)))
    assert "holds other files and is not a failure bundle" in line
    assert (precious / "notes.txt").read_text() == "important"
    # a refusal made nothing: the --out folder is checked, not made, before the --corpus check refuses
    (tmp_path / "a-file").write_text("")
    line = _one_error_line(
        epsim_here("shrink", str(found), "--out", str(tmp_path / "new" / "out"), "--corpus", str(tmp_path / "a-file"))
    )
    assert "--corpus" in line and not (tmp_path / "new").exists()


@pytest.mark.parametrize("where", ["bundle", "parent"])
def test_shrink_refuses_to_write_over_the_bundle_it_reads(found: Path, where: str) -> None:
    before = (found / "failure.json").read_text()
    out = found if where == "bundle" else found.parent
    line = _one_error_line(epsim_here("shrink", str(found), "--out", str(out)))
    assert f"{'is' if where == 'bundle' else 'holds'} the bundle being read" in line
    assert (found / "failure.json").read_text() == before


def test_shrink_corpus_beside_the_bundle_keeps_the_shrunk_bundle(found: Path) -> None:
    """--corpus naming the bundle's own folder: the shrunk bundle is already there and must stay whole."""
    done = epsim("shrink", str(found), "--corpus", str(found.parent), "--max-runs", "2", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    shrunk = Path(out["bundle"])
    assert Path(out["corpus"]).resolve() == shrunk.resolve()
    assert {"failure.json", "scenario.yaml", "history.jsonl"} <= {p.name for p in shrunk.iterdir()}
    assert epsim("replay", str(shrunk)).returncode == 0


def test_shrink_over_an_earlier_shrunk_bundle_replaces_its_files_only(found: Path) -> None:
    """The shrunk bundle of an earlier shrink, with a note a person left in it."""
    first = epsim("shrink", str(found), "--max-runs", "1", "--json")
    assert first.returncode == 0, first.stderr
    shrunk = Path(json.loads(first.stdout)["bundle"])
    (shrunk / "notes.txt").write_text("kept")
    again = epsim("shrink", str(found), "--max-runs", "1", "--json")
    assert again.returncode == 0, again.stderr
    assert (shrunk / "notes.txt").read_text() == "kept"
    assert bundle.load(shrunk).expected["signature"] == bundle.load(found).expected["signature"]


def test_shrink_of_a_bundle_that_no_longer_fails_says_so_and_writes_nothing(found: Path) -> None:
    data = json.loads((found / "failure.json").read_text())
    data["config"]["profile"] = "dram"  # the duplicate registration is allowed there: the run passes
    (found / "failure.json").write_text(json.dumps(data))
    done = epsim("shrink", str(found))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(f"not shrunk: {found} no longer fails as exception:")
    assert not (found.parent / (found.name + "-shrunk")).exists()


def test_replay_refuses_to_write_its_history_over_a_bundle(found: Path, tmp_path: Path) -> None:
    before = sorted(p.name for p in found.iterdir())
    line = _one_error_line(epsim_here("replay", str(found), "--out", str(found)))
    assert "that is the bundle being replayed" in line
    other = Path(shutil.copytree(CORPUS / "broken-finalizer-gc-late", tmp_path / "other"))
    line = _one_error_line(epsim_here("replay", str(found), "--out", str(other)))
    assert "that is a failure bundle, whose tape and history the replay would replace" in line
    assert sorted(p.name for p in found.iterdir()) == before


def test_reshrinking_a_corpus_bundle_into_its_own_corpus_replaces_it(found: Path, tmp_path: Path) -> None:
    corpus = found.parent
    done = epsim(
        "shrink",
        str(found),
        "--out",
        str(tmp_path / "out" / found.name),
        "--corpus",
        str(corpus),
        "--max-runs",
        "1",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    assert Path(json.loads(done.stdout)["corpus"]) == found
    assert bundle.load(found).data["replay"] == f"epsim replay {found}"


def test_shrink_dot_from_inside_the_bundle_names_the_shrunk_bundle_after_it(found: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "sim.cli", "shrink", ".", "--max-runs", "1", "--json"],
        cwd=found,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert Path(json.loads(done.stdout)["bundle"]) == found.parent / (found.name + "-shrunk")


def test_a_sweep_never_replaces_a_bundle_an_earlier_sweep_left(tmp_path: Path) -> None:
    bundles = tmp_path / "bundles"
    args = (
        "sweep",
        "scale-up",
        "--seeds",
        "0:1",
        "--strategy",
        "per-communicator-agent",
        "--profile",
        "rocm-strict",
        "--bundles",
        str(bundles),
        "--json",
    )
    first = epsim(*args, "--db", str(tmp_path / "a.db"))
    assert first.returncode == 0, first.stderr
    [old] = json.loads(first.stdout)["bundles"]
    (Path(old) / "notes.txt").write_text("kept")
    second = epsim(*args, "--db", str(tmp_path / "b.db"))
    assert second.returncode == 0, second.stderr
    [new] = json.loads(second.stdout)["bundles"]
    assert new == old + "-2"
    assert (Path(old) / "notes.txt").read_text() == "kept"
    assert bundle.load(new).expected == bundle.load(old).expected


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: [1, 2], "not a failure bundle of format 1"),
        (lambda d: {**d, "config": None}, "config: Input should be a valid dictionary"),
        (lambda d: {**d, "outcome": []}, "outcome: Input should be a valid dictionary"),
        (
            lambda d: {**d, "config": {k: v for k, v in d["config"].items() if k != "seed"}},
            "config.seed: Field required",
        ),
        (lambda d: {**d, "config": {**d["config"], "seed": "abc"}}, "config.seed: Input should be a valid integer"),
        (lambda d: {**d, "config": {**d["config"], "seed": -5}}, "config.seed: Input should be greater than or equal"),
        (lambda d: {**d, "config": {**d["config"], "strategy": 5}}, "config.strategy: Input should be a valid string"),
        (
            lambda d: {**d, "config": {**d["config"], "faults": "gc.late"}},
            "config.faults: Input should be a valid list",
        ),
        (lambda d: {**d, "config": {**d["config"], "faults": [5]}}, "config.faults.0: Input should be a valid string"),
        (lambda d: {**d, "config": {**d["config"], "faults": ["gc.late:delay_s=abc"]}}, "gc.late"),
        (lambda d: {**d, "outcome": {"trace_hash": "x"}}, "outcome.signature: Field required"),
    ],
)
@pytest.mark.parametrize("command", ["replay", "shrink"])
def test_a_damaged_failure_json_is_one_line(found: Path, change, message: str, command: str) -> None:
    meta = found / "failure.json"
    meta.write_text(json.dumps(change(json.loads(meta.read_text()))))
    line = _one_error_line(epsim_here(command, str(found)))
    assert line.startswith(f"epsim: error: {meta}: ") and message in line, line


def test_empty_paths_are_refused(found: Path, tmp_path: Path) -> None:
    assert "--out: an empty path" in _one_error_line(epsim_here("run", "steady", "--out", ""))
    assert "--db: " in _one_error_line(epsim_here("sweep", "steady", "--seeds", "0:1", "--db", ""))
    assert "--out: an empty path" in _one_error_line(epsim_here("shrink", str(found), "--out", ""))
    assert "--calibration: an empty path" in _one_error_line(epsim_here("run", "steady", "--calibration", ""))
    db = tmp_path / "r.db"
    assert epsim_here("sweep", "steady", "--seeds", "0:1", "--db", str(db)).returncode == 0
    assert "--plots: an empty path" in _one_error_line(epsim_here("report", str(db), "--plots", ""))


def test_run_out_with_a_directory_where_a_file_goes_is_refused_before_the_run(tmp_path: Path) -> None:
    (tmp_path / "history.jsonl").mkdir()
    line = _one_error_line(epsim_here("run", "steady", "--out", str(tmp_path)))
    assert "history.jsonl there is a directory" in line


def test_a_signature_another_sweep_bundled_meanwhile_is_not_bundled_again(tmp_path: Path) -> None:
    """Two sweeps on one database: the second learns of the first's bundle when its own run fails the same way,
    not only when it starts (else both bundle every signature)."""
    from sim.lab import resultsdb
    from sim.lab import sweep as sweep_mod

    specs = sweep_mod.plan("scale-down", range(2), ["shared-agent"])  # stale_peer on every seed

    class OtherSweepFirst:
        """Runs the specs; before handing over the first row, another sweep stores the same failure, bundled."""

        def map(self, todo):
            rows = [sweep_mod.execute(s) for s in todo]
            with resultsdb.ResultsDB(tmp_path / "r.db") as other:
                other.add({**rows[0], "run_key": "another sweep's run", "bundle": str(tmp_path / "elsewhere")})
            yield from rows

    with resultsdb.ResultsDB(tmp_path / "r.db") as db:
        out = sweep_mod.run_sweep(
            specs, db, OtherSweepFirst(), resume=False, bundles_dir=tmp_path / "bundles", command="test"
        )
    assert out.ran == 2 and out.bundles == [] and out.new_signatures == []
    assert not (tmp_path / "bundles").exists()


@pytest.mark.parametrize("tape", ["garbage", "[]", '"x"', '{"decisions": [1, 2]}'])
def test_a_damaged_tape_is_one_line_before_the_replay_runs(tape: str, tmp_path: Path) -> None:
    """A tape.json that is not JSON, or not a tape, is one line before the replay runs, not a traceback."""
    damaged = Path(shutil.copytree(CORPUS / "broken-finalizer-gc-late", tmp_path / "b"))
    (damaged / "tape.json").write_text(tape)
    out = tmp_path / "out"
    line = _one_error_line(epsim_here("replay", str(damaged), "--out", str(out)))
    assert line.startswith(f"epsim: error: {damaged / 'tape.json'}: not a")
    assert not (out / "history.jsonl").exists()  # refused before the replay
