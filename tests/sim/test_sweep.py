"""Sweeps: planning, the local engine (crashes and hangs recorded, the sweep goes on), the database (resume after
SIGKILL loses and duplicates nothing), failure bundles, replay and swarm mode."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.lab import bundle, executors, resultsdb, swarm
from sim.lab import sweep as sweep_mod
from sim.errors import ScenarioError
from sim.scenario import load
from tests.conftest import epsim, epsim_here, sigint_at_default

PCA = "per-communicator-agent"
# its crash under rocm-strict: the second live agent of a process registering the same pages is refused
PCA_CRASH = f"exception:nixlBackendError@PerAgentNixlCommunicator.__init__|{PCA}|-"


def test_plan_is_the_cross_product_with_stable_distinct_keys() -> None:
    specs = sweep_mod.plan("scale-up", range(3), ["shared-agent", PCA], ["dram", "rocm-strict"], ["gc.late:delay_s=2"])
    assert len(specs) == 12 and len({s.key for s in specs}) == 12
    assert [s.key for s in specs] == [
        s.key
        for s in sweep_mod.plan(
            "scale-up", range(3), ["shared-agent", PCA], ["dram", "rocm-strict"], ["gc.late:delay_s=2"]
        )
    ]
    assert specs[0].faults == ("gc.late:delay_s=2",) and specs[0].load_scenario().name == "scale-up"


@pytest.mark.parametrize("text, ok", [("0:5", range(0, 5)), ("7", range(7, 8)), ("5:2", None), ("a:b", None)])
def test_parse_seeds(text, ok) -> None:
    if ok is None:
        with pytest.raises(ScenarioError):
            sweep_mod.parse_seeds(text)
    else:
        assert sweep_mod.parse_seeds(text) == ok


def test_local_sweep_stores_every_run_and_bundles_each_new_signature(tmp_path: Path) -> None:
    specs = sweep_mod.plan("scale-up", range(3), ["shared-agent", PCA], ["rocm-strict"])
    with resultsdb.ResultsDB(tmp_path / "r.db") as db:
        out = sweep_mod.run_sweep(
            specs, db, executors.LocalEngine(2), resume=False, bundles_dir=tmp_path / "b", command="test"
        )
        rows = list(db.rows())
    assert out.ran == 6 and len(rows) == 6
    by = {(r["strategy"], r["seed"]): r for r in rows}
    for seed in range(3):
        assert by[("shared-agent", seed)]["verdict"] == "pass"
        crashed = by[(PCA, seed)]
        # the finding of issue 3: two live agents of one process register the same pages at PREPARE; rocm-strict
        # refuses the second registration
        assert crashed["verdict"] == "crash" and crashed["signature"] == PCA_CRASH
    assert out.new_signatures == [PCA_CRASH] and len(out.bundles) == 1
    b = bundle.load(out.bundles[0])
    assert {"failure.json", "scenario.yaml", "tape.json", "history.jsonl", "trace.perfetto.json"} <= {
        p.name for p in b.path.iterdir()
    }
    assert b.config["profile"] == "rocm-strict" and b.config["strategy"] == PCA
    assert b.expected["trace_hash"] == by[(PCA, b.config["seed"])]["trace_hash"]
    assert "nondeterministic" not in b.data
    rep = bundle.replay(b.path)
    assert rep.reproduced, (rep.result.signature, rep.result.trace_hash)
    # a second sweep over the same database without --resume refuses; with it, nothing runs twice
    with resultsdb.ResultsDB(tmp_path / "r.db") as db:
        with pytest.raises(ScenarioError, match="--resume"):
            sweep_mod.run_sweep(
                specs, db, executors.LocalEngine(1), resume=False, bundles_dir=tmp_path / "b", command="test"
            )
        again = sweep_mod.run_sweep(
            specs, db, executors.LocalEngine(1), resume=True, bundles_dir=tmp_path / "b", command="test"
        )
        assert (again.ran, again.skipped, db.count()) == (0, 6, 6)


def test_crashed_hung_and_raising_runs_are_recorded_and_the_sweep_goes_on(tmp_path: Path) -> None:
    specs = (
        sweep_mod.plan("steady", range(2), ["tests.strategies.misbehaving:crash_process"])
        + sweep_mod.plan("steady", range(1), ["tests.strategies.misbehaving:spin"])
        + sweep_mod.plan("steady", range(2), ["shared-agent"])
    )
    broken = sweep_mod.RunSpec("bad", "ranks: [not, a, number]", 0, "shared-agent", "dram")
    rows = {r["run_key"]: r for r in executors.LocalEngine(2, timeout=8).map(specs + [broken])}
    assert len(rows) == len(specs) + 1
    verdicts = [rows[s.key]["verdict"] for s in specs]
    assert verdicts == ["worker_crash", "worker_crash", "timeout", "pass", "pass"], verdicts
    assert "SIGKILL" in rows[specs[0].key]["detail"]
    error = rows[broken.key]
    assert error["verdict"] == "error" and "ScenarioError: bad: name: Field required" in error["detail"]


def test_a_run_s_timeout_does_not_count_a_fresh_worker_s_start_up() -> None:
    """A fresh worker imports the simulator (torch: over a second) before its first run, and again after a timeout
    replaced it; runs of a few hundredths of a second under a 1 s timeout all pass (counting the start-up would
    make each a timeout row, for good).  The Ray engine's side: tests/sim/test_ray_engine.py."""
    rows = list(executors.make("local", 1, 1.0).map(sweep_mod.plan("steady", range(3))))
    assert [r["verdict"] for r in rows] == ["pass"] * 3, [r["detail"] for r in rows]


def _wait_for_rows(db: Path, n: int, proc: subprocess.Popen, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if db.exists():
            try:
                with sqlite3.connect(db) as c:
                    if c.execute("SELECT COUNT(*) FROM runs").fetchone()[0] >= n:
                        return
            except sqlite3.Error:
                pass
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "sweep exited early"
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} runs stored after {limit_s} s")


def test_a_sweep_killed_with_sigkill_and_resumed_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    db = tmp_path / "k.db"
    args = ["sweep", "steady", "--seeds", "0:24", "--db", str(db), "--workers", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for_rows(db, 5, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its workers, mid-run
        proc.wait(30)
    with sqlite3.connect(db) as c:
        stored = c.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    assert 5 <= stored < 24
    done = epsim(*args, "--resume", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["skipped"] == stored and out["ran"] == 24 - stored
    with sqlite3.connect(db) as c:
        seeds = [s for (s,) in c.execute("SELECT seed FROM runs ORDER BY seed")]
    assert seeds == list(range(24))


def test_swarm_draws_depend_on_the_seed_only_and_are_stored_as_explicit_faults(tmp_path: Path) -> None:
    sc = load("elastic-cycle")
    draws = [[str(a) for a in swarm.draw(sc, seed)] for seed in range(40)]
    assert draws == [[str(a) for a in swarm.draw(sc, seed)] for seed in range(40)]
    assert len({tuple(d) for d in draws}) > 30  # seeds explore different combinations
    assert {f.partition(":")[0] for d in draws for f in d} == set(swarm.SITES)
    spec = sweep_mod.plan("scale-up", range(5, 6), swarm=True)[0]
    row = sweep_mod.execute(spec)
    assert row["faults_armed"] == [str(a) for a in swarm.draw(load("scale-up"), 5)]


def test_a_bundle_left_half_written_by_a_killed_sweep_is_written_again_and_the_row_points_at_it(
    tmp_path: Path, monkeypatch
) -> None:
    """The bundle is written before its row is stored (a sweep killed in between runs the run again on --resume),
    into the folder a killed write left without failure.json (with the row stored first and the folder left as it
    was, a signature seen once would never be bundled); the database holds absolute paths."""
    specs = sweep_mod.plan("scale-up", range(1), [PCA], ["rocm-strict"])
    half = tmp_path / "b" / f"{bundle.slug(PCA_CRASH)}-seed0"
    half.mkdir(parents=True)
    (half / "scenario.yaml").write_text("partial\n")
    monkeypatch.chdir(tmp_path)
    with resultsdb.ResultsDB(tmp_path / "r.db") as db:
        out = sweep_mod.run_sweep(
            specs, db, executors.LocalEngine(1), resume=False, bundles_dir=Path("b"), command="test"
        )
        (row,) = list(db.rows())
    assert out.bundles == [str(half)] and row["bundle"] == str(half)
    assert bundle.load(half).config["strategy"] == PCA and (half / "scenario.yaml").read_text() != "partial\n"


def test_the_default_bundles_folder_is_checked_before_any_run(tmp_path: Path) -> None:
    (tmp_path / "r-bundles").write_text("keep\n")
    done = epsim_here("sweep", "steady", "--seeds", "0:1", "--db", str(tmp_path / "r.db"))
    assert done.returncode == 2 and done.stderr == (
        f"epsim: error: the bundles folder next to --db "
        f"{tmp_path / 'r-bundles'}: that is a file; give a directory (it "
        "is made if missing)\n"
    )
    assert not (tmp_path / "r.db").exists() and (tmp_path / "r-bundles").read_text() == "keep\n"


def test_cli_sweep_bad_input_is_one_line(tmp_path: Path) -> None:
    for args, message in [
        (("--seeds", "5:2"), "B must be greater than A"),
        (("--seeds", "0:2", "--engine", "mpi"), "--engine 'mpi'"),
        (("--seeds", "0:2", "--strategy", "nope"), "nope"),
        (("--seeds", "0:2", "--fault", "gc.bogus"), "gc.bogus"),
        (("--seeds", "0:2", "--fault", "gc.late:delay_s=1,delay_s=2"), "delay_s is given twice"),
        # the plan would be built in memory until MemoryError
        (("--seeds", "0:10000000000000"), "one sweep plans at most 1,000,000 runs"),
        (
            ("--seeds", "0:400000", "--profile", "dram", "--profile", "cuda", "--profile", "rdma"),
            "400000 seeds x 1 strategies x 3 profiles",
        ),
        (("--seeds", "9223372036854775807:9223372036854775809"), "seeds go up to"),
        (("--seeds", "0:1", "--ray-address", "localhost:1"), "--ray-address is for --engine ray"),
        (("--seeds", "0:1", "--db", ""), "--db: an empty path"),
        (("--seeds", "0:1", "--db", str(tmp_path)), "that is a directory"),
    ]:
        done = epsim_here("sweep", "steady", *args, *(() if "--db" in args else ("--db", str(tmp_path / "x.db"))))
        assert done.returncode == 2, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr
    done = epsim("replay", str(tmp_path))
    assert done.returncode == 2 and "not a failure bundle" in done.stderr


def test_a_ray_address_nothing_listens_on_is_one_line_and_leaves_no_database(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="the Ray engine needs the ray extra (pip install 'epsim[ray]')")
    with socket.socket() as s:  # a port of this machine that nothing listens on: Ray would retry it for minutes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        db = tmp_path / "r.db"
        done = epsim_here(
            "sweep", "steady", "--seeds", "0:1", "--engine", "ray", "--ray-address", address, "--db", str(db)
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"epsim: error: --ray-address {address}: cannot reach 127.0.0.1:{port} (Connection refused)"
        ]
        assert not db.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tables", [["CREATE TABLE foo (x)"], ["CREATE TABLE runs (x)"]])
def test_a_sweep_leaves_a_sqlite_file_of_something_else_as_it_was(tmp_path: Path, tables: list[str]) -> None:
    db = tmp_path / "theirs.db"
    with sqlite3.connect(db) as c:
        for sql in tables:
            c.execute(sql)
    before = db.read_bytes()
    done = epsim("sweep", "steady", "--seeds", "0:1", "--db", str(db))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"epsim: error: {db}: a file that is not an epsim results database; "
        "give a new file, or one that epsim sweep wrote"
    ]
    assert db.read_bytes() == before and not (tmp_path / "theirs.db-wal").exists()


def test_a_plot_that_cannot_be_written_keeps_the_earlier_one_and_the_summary_is_printed(tmp_path: Path) -> None:
    """(A full disk, made here by a folder where the plot is written first.)"""
    from sim.lab.report import PLOTS

    db = tmp_path / "r.db"
    assert epsim("sweep", "steady", "--seeds", "0:2", "--db", str(db)).returncode == 0
    assert epsim_here("report", str(db)).returncode == 0
    folder = tmp_path / "r-report"
    earlier = (folder / PLOTS[0]).read_bytes()
    (folder / f".{PLOTS[0]}.{os.getpid()}.part").mkdir()
    done = epsim_here("report", str(db), "--json")
    assert done.returncode == 2 and json.loads(done.stdout)["runs"] == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"epsim: error: {folder / PLOTS[0]}: could not write the plot (") and line.endswith(
        "); an earlier one there is kept"
    ), line
    assert (folder / PLOTS[0]).read_bytes() == earlier


def test_report_on_a_database_changed_behind_its_back_is_one_line(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    assert epsim("sweep", "steady", "--seeds", "0:2", "--db", str(db)).returncode == 0
    changed = tmp_path / "changed.db"
    changed.write_bytes(db.read_bytes())
    with sqlite3.connect(changed) as c:
        c.execute("UPDATE runs SET faults_armed='not json' WHERE id=2")
    done = epsim("report", str(changed), "--no-plots")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"epsim: error: {changed}: run 2's faults_armed is not JSON; the "
        "database was changed by something other than epsim"
    ]
    # valid JSON of another shape, and JSON nested past the parser's depth, are refused the same way
    for column, value, said in [
        ("faults_armed", "[1]", "is not a list of fault strings"),
        ("faults_fired", "[1, 2]", "is not an object of fault sites and counts"),
        ("metrics", "5", "is not an object of metrics"),
        ("implicated", '"x"', "is not a list of fault strings"),
        ("faults_requested", "[" * 1200 + "]" * 1200, "is not JSON"),
    ]:
        with sqlite3.connect(changed) as c:
            c.execute(
                "UPDATE runs SET faults_armed='[]', faults_fired='{}', metrics='{}', implicated='[]', "
                "faults_requested='[]'"
            )
            c.execute(f"UPDATE runs SET {column}=? WHERE id=2", (value,))
        done = epsim_here("report", str(changed), "--no-plots")  # (in this interpreter: seconds less each)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [
            f"epsim: error: {changed}: run 2's {column} {said}; the database was changed by something other than epsim"
        ], done.stderr
    with sqlite3.connect(changed) as c:
        c.execute("ALTER TABLE runs DROP COLUMN metrics")
    for args in (("report", str(changed)), ("sweep", "steady", "--seeds", "0:3", "--resume", "--db", str(changed))):
        done = epsim(*args)
        assert done.returncode == 2 and "its runs table lacks metrics" in done.stderr, done.stderr
    (tmp_path / "r-report").write_text("a file where the plots would go")
    done = epsim("report", str(db))
    assert done.returncode == 2 and "the default --plots" in done.stderr and "that is a file" in done.stderr


@pytest.mark.parametrize(
    "path, line", [(".", ".: that is a directory; give a file name"), ("/", "/: that is a directory; give a file name")]
)
def test_report_on_a_directory_is_one_line_also_without_plots(path: str, line: str) -> None:
    """Deriving the default plots folder from the path before checking it would be a traceback for '.' and '/'."""
    done = epsim_here("report", path, "--no-plots")
    assert (done.returncode, done.stderr) == (2, f"epsim: error: {line}\n")


def _as_a_user(*args: str) -> subprocess.CompletedProcess:
    """``epsim ARGS`` in a fresh interpreter that file permissions apply to: as root, without the capabilities that
    override them (``setpriv``, util-linux)."""
    import shutil

    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: file permissions cannot be enforced")
        prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
    return subprocess.run(
        [*prefix, sys.executable, "-m", "sim.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_a_read_only_database_is_one_line_for_a_sweep_and_readable_for_a_report(tmp_path: Path) -> None:
    """A sweep into a read-only database file is one line, not a traceback at its first write (leaving -wal and
    -shm files), and a report reads a database in a read-only folder, though SQLite's WAL mode needs its -shm file
    even to read."""
    folder = tmp_path / "ro"
    folder.mkdir()
    db = folder / "r.db"
    assert epsim("sweep", "steady", "--seeds", "0:2", "--db", str(db)).returncode == 0
    for name in ("r.db-wal", "r.db-shm"):
        (folder / name).unlink(missing_ok=True)  # as a copy of the database alone would be
    db.chmod(0o444)
    before = sorted(p.name for p in folder.iterdir())
    done = _as_a_user("sweep", "steady", "--seeds", "5:7", "--db", str(db))
    assert (done.returncode, done.stderr) == (
        2,
        f"epsim: error: {db}: cannot write to it (Permission denied); give a file you can write\n",
    )
    assert sorted(p.name for p in folder.iterdir()) == before
    folder.chmod(0o555)
    try:
        done = _as_a_user("report", str(db), "--no-plots", "--json")
    finally:
        folder.chmod(0o755)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["runs"] == 2


def test_a_report_leaves_nothing_beside_the_database_it_read(tmp_path: Path) -> None:
    """A finished sweep's database is one file (the sweep leaves WAL mode at its end), and a report that reads it
    makes no -wal or -shm beside it; nor on a database still in WAL mode with no sweep writing it (an older
    epsim's, or one whose sweep was killed)."""
    db = tmp_path / "r.db"
    assert epsim("sweep", "steady", "--seeds", "0:2", "--db", str(db)).returncode == 0
    assert not list(tmp_path.glob("r.db-*[lm]"))  # no -wal, no -shm
    done = epsim("report", str(db), "--no-plots", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["runs"] == 2
    assert not list(tmp_path.glob("r.db-*[lm]"))
    with sqlite3.connect(db) as con:  # as an older epsim left it
        con.execute("PRAGMA journal_mode=WAL")
    assert not (tmp_path / "r.db-wal").exists() and resultsdb._in_wal_mode(db)
    done = epsim("report", str(db), "--no-plots", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["runs"] == 2
    assert not list(tmp_path.glob("r.db-*[lm]"))


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stopped_sweep_says_how_many_runs_it_kept_and_how_to_go_on(tmp_path: Path, signum, code) -> None:
    db = tmp_path / "s.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim.cli", "sweep", "steady", "--seeds", "0:100000", "--db", str(db), "--workers", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_at_default,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until some runs are stored
            time.sleep(0.5)
            if db.exists():
                try:
                    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
                        if con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] >= 3:
                            break
                except sqlite3.Error:
                    pass
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:  # a sweep that did not stop must not go on sweeping (and taking a core) for the rest of the suite
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("epsim: interrupted: "), lines
    kept = int(lines[0].split()[2])
    assert f"runs of this sweep kept in {db}; the same command with --resume runs the rest" in lines[0]
    with resultsdb.open_existing(db) as stored:
        assert stored.count() == kept >= 3
