"""Shrinking failure bundles (the rocm-strict finding and a GC-fault failure), and ``epsim report``'s content."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim.lab import bundle, report, resultsdb, shrink
from sim.scenario import load

PCA = "per-communicator-agent"
BROKEN = "tests.strategies.broken_shared_agent:create"
# Faults that a swarm could have added around the real cause: they fire (or not) without causing the failure.
NOISE = [
    "nixl.notif.delay:delay=0.5",
    "gc.late:delay_s=60,rank=1",
    "storage.move:at_step=50000",
    "nixl.xfer.late:at_step=2000,delay=0.01",
]


def _bundle(tmp_path: Path, name: str, strategy: str, profile: str, faults: list[str]) -> Path:
    path = tmp_path / "found"
    bundle.write_config(path, load(name), seed=3, strategy=strategy, profile=profile, faults=faults)
    return path


@pytest.mark.parametrize(
    "name, strategy, profile, faults, signature",
    [
        # per-communicator-agent registers the same pages with a second live agent at every PREPARE: rocm-strict
        # refuses it; elastic-cycle has three elastic events, the failure needs one
        (
            "elastic-cycle",
            PCA,
            "rocm-strict",
            NOISE,
            f"exception:nixlBackendError@PerAgentNixlCommunicator.__init__|{PCA}|-",
        ),
        # the broken shared-agent's finalizer, run half a second late, deregisters memory a later move still reads
        (
            "elastic-cycle",
            BROKEN,
            "dram",
            ["gc.late:delay_s=0.5"] + NOISE,
            f"exception:nixlNotFoundError@NixlReadCommunicator.add_recv|{BROKEN}|gc.late",
        ),
    ],
)
def test_shrink_keeps_the_signature_with_at_most_three_faults_and_one_elastic_event(
    tmp_path: Path, name, strategy, profile, faults, signature
) -> None:
    found = _bundle(tmp_path, name, strategy, profile, faults)
    assert bundle.load(found).expected["signature"] == signature
    res = shrink.shrink(found, tmp_path / "shrunk", max_runs=80)
    assert res.bundle is not None
    small = bundle.load(res.bundle)
    assert small.expected["signature"] == signature
    assert len(small.config["faults"]) <= 3 and small.config["elastic_events"] <= 1, small.config
    assert res.final.size() < res.original.size() and res.removed == small.data["removed"]
    assert small.data["shrunk_from"] == str(found)
    # the original's description would say what the shrunk scenario no longer does
    assert small.scenario().description.startswith(f"{name} (") and res.removed[0] in small.scenario().description
    rep = bundle.replay(res.bundle)
    assert rep.reproduced and rep.result.signature == signature
    # the CLI says the same
    done = subprocess.run(
        [sys.executable, "-m", "sim.cli", "replay", str(res.bundle), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and json.loads(done.stdout)["signature"] == signature


def _row(
    key: str,
    strategy: str,
    verdict: str,
    faults: list[str],
    fired: dict[str, int],
    implicated: list[str],
    signature: str | None,
    bundle_path: str | None = None,
) -> dict:
    return {
        "run_key": key,
        "scenario": "scale-up",
        "scenario_digest": "d",
        "seed": int(key[1:]),
        "strategy": strategy,
        "profile": "dram",
        "faults_requested": [],
        "swarm": 1,
        "verdict": verdict,
        "invariant": None,
        "detail": None,
        "signature": signature,
        "trace_hash": "h",
        "events": 1,
        "sim_time_s": 1.0,
        "wall_s": 0.1,
        "faults_armed": faults,
        "faults_fired": fired,
        "implicated": implicated,
        "metrics": {},
        "bundle": bundle_path,
        "finished_at": 0.0,
    }


@pytest.fixture
def known_db(tmp_path: Path) -> Path:
    """Six runs whose summary is worked out by hand below."""
    rows = [
        _row("k0", "shared-agent", "pass", ["gc.late:delay_s=2"], {"gc.late:delay_s=2": 1}, [], None),
        _row(
            "k1",
            "shared-agent",
            "crash",
            ["gc.late:delay_s=2", "peer.restart"],
            {"peer.restart": 1},
            ["peer.restart"],
            "exception:X|shared-agent|peer.restart",
            "/b/1",
        ),
        _row(
            "k2",
            "shared-agent",
            "crash",
            ["peer.restart"],
            {"peer.restart": 2},
            ["peer.restart"],
            "exception:X|shared-agent|peer.restart",
        ),
        _row("k3", PCA, "safety", ["gc.cycle"], {"gc.cycle": 0}, [], f"stale_peer|{PCA}|-", "/b/3"),
        _row("k4", PCA, "pass", [], {}, [], None),
        _row("k5", PCA, "timeout", [], {}, [], f"timeout|{PCA}|-"),
    ]
    path = tmp_path / "known.db"
    with resultsdb.ResultsDB(path) as db:
        for r in rows:
            assert db.add(r)
        assert not db.add(rows[0])  # a key is stored once
    return path


def test_report_summary_counts(known_db: Path) -> None:
    with resultsdb.open_existing(known_db) as db:
        s = report.summarise(db)
    assert s.runs == 6
    assert s.verdicts == {"pass": 2, "crash": 2, "safety": 1, "timeout": 1}
    assert s.by_config[("shared-agent", "dram")] == {"pass": 1, "crash": 2}
    assert s.signatures == {"exception:X|shared-agent|peer.restart": 2, f"stale_peer|{PCA}|-": 1, f"timeout|{PCA}|-": 1}
    assert s.signature_bundle["exception:X|shared-agent|peer.restart"] == "/b/1"
    assert (s.armed["gc.late"], s.fired["gc.late"], s.implicated["gc.late"]) == (2, 1, 0)
    assert (s.armed["peer.restart"], s.fired["peer.restart"], s.implicated["peer.restart"]) == (2, 2, 2)
    assert (s.armed["gc.cycle"], s.fired["gc.cycle"]) == (1, 0)
    assert s.failure_rate("gc.late") == 0.5 and s.failure_rate("peer.restart") == 1.0


def test_report_cli_tables_json_and_plots(known_db: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need the plot extra (pip install 'epsim[plot]')")
    from PIL import Image, PngImagePlugin

    plots = tmp_path / "plots"
    done = subprocess.run(
        [sys.executable, "-m", "sim.cli", "report", str(known_db), "--plots", str(plots)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "200", "PATH": ""},
    )
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "6 runs: verdicts per strategy x profile" in text
    assert "exception:X|shared-agent|peer.restart" in text and "epsim replay /b/1" in text
    assert "peer.restart" in text and "100.0%" in text and "50.0%" in text

    done = subprocess.run(
        [sys.executable, "-m", "sim.cli", "report", str(known_db), "--plots", str(plots), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = json.loads(done.stdout)
    assert out["runs"] == 6 and out["verdicts"] == {"crash": 2, "pass": 2, "safety": 1, "timeout": 1}
    assert out["signatures"]["exception:X|shared-agent|peer.restart"] == 2
    assert out["coverage"]["peer.restart"] == {"armed": 2, "fired": 2, "implicated": 2, "failure_rate": 1.0}

    rate_png = plots / "failure_rate_by_site.png"
    assert sorted(out["plots"]) == sorted([str(rate_png), str(plots / "verdicts_by_config.png")])
    img = Image.open(rate_png)
    assert isinstance(img, PngImagePlugin.PngImageFile)
    drawn = json.loads(img.text["Description"])
    # gc.cycle never fired: its runs failed (for another reason), and it is implicated in none of them
    assert drawn == {
        "gc.cycle": {"armed": 1, "fired": 0, "failed": 1, "implicated": 0, "rate": 1.0, "implicated_rate": 0.0},
        "gc.late": {"armed": 2, "fired": 1, "failed": 1, "implicated": 0, "rate": 0.5, "implicated_rate": 0.0},
        "peer.restart": {"armed": 2, "fired": 2, "failed": 2, "implicated": 2, "rate": 1.0, "implicated_rate": 1.0},
    }
    # the bars are there: peer.restart's "failed after it fired" reaches the top of the axis
    rgb = img.convert("RGB")
    bar = (0xC0, 0x39, 0x2B)
    columns = {x for x in range(rgb.width) for y in range(0, rgb.height, 4) if rgb.getpixel((x, y)) == bar}
    assert len(columns) > 20
    verdict_img = Image.open(plots / "verdicts_by_config.png")
    assert isinstance(verdict_img, PngImagePlugin.PngImageFile)
    verdict_png = json.loads(verdict_img.text["Description"])
    assert verdict_png == {
        f"{PCA}/dram": {"pass": 1, "safety": 1, "timeout": 1},
        "shared-agent/dram": {"crash": 2, "pass": 1},
    }


def test_report_of_a_file_that_is_not_a_database_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "notes.db"
    bad.write_text("hello, not sqlite")
    done = subprocess.run(
        [sys.executable, "-m", "sim.cli", "report", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "not a usable SQLite results database" in done.stderr
    assert bad.read_text() == "hello, not sqlite"  # nothing written over it


def test_report_refuses_an_empty_file_or_another_sqlite_database_and_leaves_them_as_they_were(tmp_path: Path) -> None:
    """SQLite opens an empty file as an empty database: a report used to write epsim's tables into it."""
    import sqlite3

    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t (x)")
    before = other.read_bytes()
    for path in (empty, other):
        done = subprocess.run(
            [sys.executable, "-m", "sim.cli", "report", str(path)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [
            f"epsim: error: {path}: not an epsim results database (write one with `epsim sweep ... --db {path}`)"
        ]
    assert empty.read_bytes() == b"" and other.read_bytes() == before
    assert not (tmp_path / "empty-report").exists()


def test_a_results_database_of_another_schema_is_refused_by_report_and_sweep(tmp_path: Path) -> None:
    import sqlite3

    from sim.lab import resultsdb

    path = tmp_path / "old.db"
    with resultsdb.ResultsDB(path):
        pass
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value='0' WHERE key='schema'")
    for opened in (lambda: resultsdb.open_existing(path), lambda: resultsdb.ResultsDB(path)):
        with pytest.raises(
            resultsdb.DatabaseError, match=f"{path}: results schema 0, this epsim reads {resultsdb.SCHEMA_VERSION}"
        ):
            opened()


def test_the_seeds_column_says_when_it_shows_only_the_first_seeds(tmp_path: Path) -> None:
    from rich.console import Console

    path = tmp_path / "many.db"
    with resultsdb.ResultsDB(path) as db:
        for seed in range(7):
            row = _row(f"m{seed}", "shared-agent", "safety", [], {}, [], "stale_peer|shared-agent|-")
            assert db.add({**row, "seed": seed})
    with resultsdb.open_existing(path) as db:
        s = report.summarise(db)
    console = Console(record=True, width=200)
    report.render(s, console)
    assert "0, 1, 2, 3, 4, ... (7 runs)" in console.export_text()
