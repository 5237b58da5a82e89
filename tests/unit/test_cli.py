"""The epsim command: version, one-line errors with exit status 2, and ``conform`` on the fake."""

from __future__ import annotations

import json

import pytest

from tests.conftest import epsim, epsim_here, epsim_loading


def test_version() -> None:
    from sim import __version__

    done = epsim("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"epsim {__version__}"


@pytest.mark.parametrize(
    "args, message",
    [
        (("conform", "--backend", "nope"), "backend 'nope' not known; use one of: fake, real"),
        (("conform", "--profile", "strict"), "profile 'strict' not known; known: dram, cuda, rdma, rocm-strict"),
        (("conform", "--memory", "hbm"), "memory 'hbm' not known; use one of: dram, vram"),
        (("conform", "--bogus"), "No such option: --bogus"),
        (("no-such-command",), "No such command"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message) -> None:
    done = epsim_here(*args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("epsim: error: ") and message in lines[0]
    assert "Traceback" not in done.stderr


def test_bad_arguments_are_refused_before_the_simulation_is_imported(tmp_path) -> None:
    """A typo costs the user no torch import (seconds on a small machine): what a command checks first needs only
    the scenario, the fault catalogue and the bundle reader."""
    cases = [
        ["run", "no-such-scenario"],
        ["run", "scale-up", "--fault", "no.such:site"],
        ["replay", str(tmp_path / "no-bundle")],
        ["shrink", str(tmp_path / "no-bundle")],
        ["scenarios"],
    ]
    for args in cases:
        done, heavy = epsim_loading(*args, watch=("torch", "numpy", "simpy", "fakes.nixl._agent"), timeout=120)
        assert heavy == [], (args, done.stderr)


def test_conform_fake_json_names_dram() -> None:
    done = epsim("conform", "--backend", "fake", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["matched_profile"] == "dram"
    assert len(report["cases"]) >= 40
    assert {c["outcome"] for c in report["cases"]} == {"pass"}
    assert {"name", "outcome"} <= set(report["cases"][0])


def test_conform_fake_strict_profile_text() -> None:
    done = epsim("conform", "--backend", "fake", "--profile", "rdma")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1].endswith("matched profile: rdma")
    assert all(line.startswith("pass") for line in lines[:-1])


@pytest.mark.parametrize(
    "outcomes, matched, status",
    [
        (["pass", "pass"], "dram", 0),
        (["pass", "fail"], "dram", 1),
        (["pass", "pass"], None, 1),
        (["pass", "skip"], "cuda", 0),
    ],
)
def test_conform_exit_status(monkeypatch, capsys, outcomes, matched, status) -> None:
    """0 only when every case holds and a profile matched; the status survives the one-line error wrapper."""
    from sim import cli, conform

    report = {
        "backend": "real",
        "memory": "DRAM",
        "profile": "dram",
        "matched_profile": matched,
        "cases": [{"name": f"c{i}", "outcome": o, "observed": 1, "expected": 1} for i, o in enumerate(outcomes)],
        "notes": ["c0: the catalogue's process died in it (SIGSEGV)"],
    }  # a death run again changes nothing
    monkeypatch.setattr(conform, "run", lambda backend, profile, memory: report)
    with pytest.raises(SystemExit) as done:
        cli.main(["conform", "--backend", "real"])
    assert done.value.code == status
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1].endswith(f"matched profile: {matched or 'none'}")
    assert err.splitlines() == ["epsim: note: c0: the catalogue's process died in it (SIGSEGV)"]


def test_conform_on_an_unusable_backend_is_one_line_exit_2() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: --memory vram is usable here")
    done = epsim("conform", "--backend", "real", "--memory", "vram")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["epsim: error: --memory vram needs a CUDA GPU; none is visible"]


@pytest.mark.parametrize(
    "command",
    [
        ("run", "steady", "--out", "{bad}"),
        ("replay", "tests/corpus/broken-finalizer-gc-late", "--out", "{bad}"),
        ("shrink", "tests/corpus/broken-finalizer-gc-late", "--out", "{bad}"),
        ("shrink", "tests/corpus/broken-finalizer-gc-late", "--out", "{ok}", "--corpus", "{bad}"),
        ("sweep", "steady", "--seeds", "0:1", "--db", "{ok}/r.db", "--bundles", "{bad}"),
    ],
)
def test_an_output_path_that_cannot_be_written_is_one_line_before_any_work(command, tmp_path) -> None:
    (tmp_path / "a-file").write_text("")
    bad = tmp_path / "a-file" / "sub"  # under a file: no directory can be made there, whoever runs the test
    option = command[command.index("{bad}") - 1]
    done = epsim(*(a.format(bad=bad, ok=tmp_path / "ok") for a in command))
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    # made at once (run, replay, sweep): the OS's word; only checked (shrink's folders): which part is a file
    assert line in (
        f"epsim: error: {option} {bad}: cannot write there (Not a directory); give a path you can write to",
        f"epsim: error: {option} {bad}: {bad.parent} is a file, not a directory",
    ), line
    assert not done.stdout.strip()  # nothing ran


def test_output_paths_name_what_is_wrong(tmp_path) -> None:
    from sim.errors import BadOutput
    from sim.outputs import writable_dir, writable_file

    (tmp_path / "a-file").write_text("kept")
    with pytest.raises(BadOutput, match="that is a file; give a directory"):
        writable_dir(tmp_path / "a-file", "--out")
    with pytest.raises(BadOutput, match="that is a directory; give a file name"):
        writable_file(tmp_path, "--out")
    with pytest.raises(BadOutput, match=r"--out .*a-file/x\.json: .*a-file is a file, not a directory"):
        writable_file(tmp_path / "a-file" / "x.json", "--out")
    assert writable_dir(tmp_path / "new" / "deeper", "--out").is_dir()
    assert writable_file(tmp_path / "made" / "c.json", "--out").parent.is_dir()
    assert (tmp_path / "a-file").read_text() == "kept"
    assert not list((tmp_path / "new" / "deeper").iterdir())  # the probe leaves nothing behind


def test_a_run_whose_files_cannot_be_written_prints_its_result_then_one_line(tmp_path) -> None:
    """A write error after the run (a full disk) must not lose the verdict in a traceback with exit 1: the result
    comes first, then one line, exit 2; the files already there stay whole, and together: none is replaced until
    every new one is written, so a full disk cannot leave the new history beside the earlier run's result."""
    out = tmp_path / "o"
    assert epsim_here("run", "steady", "--out", str(out)).returncode == 0  # an earlier run's folder
    (out / "history.jsonl").write_text("an earlier run\n")
    earlier_result = (out / "result.json").read_text()
    (out / "trace.perfetto.json").unlink()
    (out / ".trace.perfetto.json.part").mkdir()  # where the trace is written first: writing it fails
    done = epsim_here("run", "steady", "--out", str(out), "--json")
    assert done.returncode == 2, done.stderr
    assert json.loads(done.stdout)["verdict"] == "pass"
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"epsim: error: --out {out}: could not write the run's files")
    assert line.endswith("; the run's result is printed above")
    assert (out / "history.jsonl").read_text() == "an earlier run\n"  # the earlier run's, untouched
    assert (out / "result.json").read_text() == earlier_result
    assert not (out / ".history.jsonl.part").exists() and not (out / ".result.json.part").exists()


def test_run_files_never_mix_two_runs_and_a_bundle_is_not_overwritten(tmp_path) -> None:
    from sim.outputs import write_run_files

    out = tmp_path / "o"
    out.mkdir()
    for name in ("tape.json", "result.json", "notes.txt"):
        (out / name).write_text("old")
    write_run_files(
        out, {"history.jsonl": lambda p: p.write_text("h"), "result.json": lambda p: p.write_text("r")}, result=None
    )  # a real run writes no tape: an older run's tape goes
    assert sorted(p.name for p in out.iterdir()) == ["history.jsonl", "notes.txt", "result.json"]
    assert (out / "result.json").read_text() == "r" and (out / "notes.txt").read_text() == "old"
    done = epsim_here("run", "steady", "--out", "tests/corpus/broken-finalizer-gc-late")
    assert done.returncode == 2 and "that is a failure bundle" in done.stderr and not done.stdout.strip()


@pytest.mark.parametrize(
    "fault, message",
    [
        ("gc.late:delay_s=abc", "fault gc.late: delay_s='abc' must be a number of seconds >= 0"),
        ("gc.late:delay_s=-1", "fault gc.late: delay_s=-1 must be a number of seconds >= 0"),
        ("nixl.xfer.late:delay=inf", "fault nixl.xfer.late: delay=inf must be a number >= 0"),
        ("gc.cycle:rank=1.5", "fault gc.cycle: rank=1.5 must be a whole number >= 0"),
        ("gc.cycle:times=0", "fault gc.cycle: times=0 must be a whole number >= 1"),
        ("nixl.xfer.fail_after:polls=true", "fault nixl.xfer.fail_after: polls=True must be a whole number >= 1"),
        ("nixl.register.fail:error=BOGUS", "fault nixl.register.fail: error='BOGUS' is not a NIXL status; use one of"),
    ],
)
def test_a_fault_parameter_of_the_wrong_kind_is_one_line_before_the_run(fault, message) -> None:
    """Before, ``delay_s=abc`` reached the GC controller mid-run and read as the code under test crashing."""
    done = epsim_here("run", "steady", "--fault", fault)
    assert done.returncode == 2 and not done.stdout.strip(), (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"epsim: error: {message}"), done.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        # each of these hung, ran out of memory, or was read as the code under test failing, before it was refused
        (("--set", "timeline.0.prepare_s=.inf"), "timeline[0].prepare_s: Input should be a finite number"),
        (("--set", "serving.step_time_s=1.0e-320"), "serving.step_time_s: Input should be greater than or equal to"),
        (("--set", "serving.step_time_s=.inf"), "serving.step_time_s: Input should be a finite number"),
        (("--set", "serving.step_time_s=.nan"), "serving.step_time_s: Input should be a finite number"),  # was "range"
        (("--set", "ranks=1000000", "--set", "max_ranks=null", "--set", "timeline=[]"), "ranks: Input should be less"),
        (("--set", "steps=1000000000000"), "steps: Input should be less than or equal to 1000000000"),
        (("--set", "model.hidden=10000000000"), "model.hidden: Input should be less than or equal to 16777216"),
        (("--set", "model.nominal_expert_bytes=" + "9" * 400), "model.nominal_expert_bytes: Input should be less"),
        (("--set", "model.hidden=60000", "--set", "model.layers=200"), "simulated weight elements, over the"),
        (("--set", "model=[1"), "--set 'model=[1': the value is not a YAML scalar or list"),
        (("--set", "model.layers=!!python/object:os.system"), "the value is not a YAML scalar or list"),
        (("--set", "name="), "--set 'name=': no value; write name=null for none"),
        (("--seed", "-1"), "Invalid value for '--seed'"),
        (("--fault", "gc.late:at_step=999999"), "at_step 999999 is not before the scenario's steps = 3000"),
        (("--fault", "gc.late:rank=99"), "rank 99 never exists; the scenario starts rank processes 0..3"),
        (("--fault", "all2all.cleanup_late"), "the scenario has no all2all buffers"),
        (("--fault", "gc.late:delay_s=1,delay_s=2"), "delay_s is given twice"),
        (("--fault", "gc.late:"), "nothing after ':'; give k=v parameters or leave the ':' out"),
        (("--fault", "gc.late:delay_s=1,,rank=0"), "parameters are k=v separated by commas"),
        (("--fault", "gc.late:delay_s=1,"), "parameters are k=v separated by commas"),
        (("--profile", ""), "--profile: empty"),
        (("--strategy", ""), "--strategy: empty"),
        (("--timeout", "5"), "--timeout bounds a real rank's answer"),
        (("--out", ""), "--out: an empty path"),
    ],
)
def test_bad_run_input_found_by_probing_is_one_line_before_the_run(args, message) -> None:
    done = epsim_here("run", "scale-up", *args)
    assert done.returncode == 2 and not done.stdout.strip(), (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("epsim: error: ") and message in lines[0], done.stderr


@pytest.mark.parametrize(
    "command",
    [
        ("run", "steady", "--backend", "real"),
        ("sweep", "steady", "--seeds", "0:1"),
        ("validate", "--quick"),
    ],
)
def test_a_timeout_past_a_week_is_one_line_before_any_work(command, tmp_path) -> None:
    """1e10 s overflows a thread wait or a gloo store's milliseconds: one line, not a traceback."""
    done = epsim_here(*command, "--timeout", "1e10", *(("--db", str(tmp_path / "r.db")) if "sweep" in command else ()))
    assert done.returncode == 2 and not done.stdout.strip(), (done.stdout, done.stderr)
    assert done.stderr.strip() == (
        "epsim: error: Invalid value for '--timeout': Input should be less than or equal to 604800"
    )
    assert not (tmp_path / "r.db").exists()


def test_scenario_files_that_are_not_files_or_too_big_are_one_line(tmp_path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 200_000)
    for path, message in (("/dev/zero", "not a regular file"), (str(big), "a scenario file is at most")):
        done = epsim_here("run", path)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_scenarios_lists_the_good_files_and_names_a_broken_one(tmp_path) -> None:
    import os
    import shutil
    import subprocess
    import sys

    from sim.scenario import builtin_dir

    shutil.copy(builtin_dir() / "steady.yaml", tmp_path / "steady.yaml")
    (tmp_path / "bad.yaml").write_text("ranks: [\n")
    env = dict(os.environ, EPSIM_SCENARIO_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "sim.cli", "scenarios"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 2 and done.stdout.startswith("steady ")
    assert done.stderr.strip().splitlines() == [
        f"epsim: error: {tmp_path / 'bad.yaml'}:2:1: invalid YAML: expected the node content, but found '<stream end>'"
    ]
    env["EPSIM_SCENARIO_DIR"] = str(tmp_path / "missing")
    done = subprocess.run(
        [sys.executable, "-m", "sim.cli", "scenarios"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 2 and "no scenario folder at" in done.stderr


def test_a_strategy_module_that_exits_while_importing_is_one_line(tmp_path, monkeypatch) -> None:
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.chdir(tmp_path)
    done = epsim("run", "steady", "--strategy", "exits_on_import:create", timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "epsim: error: strategy 'exits_on_import:create': importing 'exits_on_import' failed: SystemExit: 3"
    ]


def test_check_determinism_catches_a_strategy_whose_history_follows_the_hash_seed(tmp_path, monkeypatch) -> None:
    """A strategy that names an agent after a set's iteration order (str hashes: PYTHONHASHSEED) gives another
    history in the rerun: the check says DIFFERENT, exits 1, and --json says ``same: false``."""
    (tmp_path / "hash_order.py").write_text(
        "from nixl._api import nixl_agent\n"
        "from sim.eplb.communicators.shared_agent import create as shared\n"
        "kept = []\n"
        "def create(group, expert_weights, expert_buffer, prev_communicator=None):\n"
        "    if not kept:  # one agent per process, named in the set's order\n"
        "        kept.append(nixl_agent('-'.join({'alpha', 'beta', 'gamma', 'delta', 'epsilon', 'zeta'})))\n"
        "    return shared(group, expert_weights, expert_buffer, prev_communicator)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # the rerun takes another fixed seed: the outcome is repeatable
    done = epsim("run", "steady", "--strategy", "hash_order:create", "--check-determinism", "--json", timeout=120)
    payload = json.loads(done.stdout)
    assert done.returncode == 1 and payload["determinism"]["same"] is False, done.stderr[-500:]
    assert payload["determinism"]["trace_hash_again"] != payload["trace_hash"]
    done = epsim("run", "steady", "--strategy", "hash_order:create", "--check-determinism", timeout=120)
    assert "(DIFFERENT)" in done.stdout and done.returncode == 1


def test_a_calibration_with_an_infinite_time_is_one_line(tmp_path) -> None:
    cal = tmp_path / "cal.json"
    cal.write_text('{"xfer_latency_s": Infinity, "bandwidth_Bps": 1e9}')
    done = epsim_here("run", "steady", "--calibration", str(cal))
    assert done.returncode == 2 and "xfer_latency_s: Input should be a finite number" in done.stderr


def test_a_quick_calibration_is_used_with_a_warning(tmp_path) -> None:
    cal = tmp_path / "cal.json"
    cal.write_text('{"xfer_latency_s": 2e-5, "bandwidth_Bps": 1e9, "quick": true}')
    done = epsim_here("run", "steady", "--calibration", str(cal), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["verdict"] == "pass"
    assert done.stderr.splitlines() == [
        f"epsim: warning: calibration {cal} was measured with `epsim calibrate "
        f"--quick` (three sizes, a few repeats): a check that the path works, not "
        f"times to trust"
    ]
    cal.write_text('{"xfer_latency_s": 2e-5, "bandwidth_Bps": 1e9}')
    assert epsim_here("run", "steady", "--calibration", str(cal), "--json").stderr == ""


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ("--fault", "gc.late:times=1", "--fault", "gc.late:times=1"),
            "fault gc.late:times=1 is armed twice (counting the scenario's own faults); "
            "arm it once, with times=N for N firings",
        ),
        (
            ("--fault", "gc.late:what=communicators"),
            "fault gc.late: what='communicators' is part of no drop's name, so it would never fire; drops are: old "
            "communicator, aborted communicator, prepared, aborted, communicator at exit, old all2all buffer, all2all "
            "buffer at exit",
        ),
        (
            ("--set", "all2all.backend=deepep_high_throughput", "--fault", "all2all.parity_skew"),
            "--fault all2all.parity_skew: only low-latency buffers have a double-buffer parity (set "
            "all2all.backend=deepep_low_latency)",
        ),
    ],
)
def test_a_fault_that_could_not_fire_as_written_is_one_line(args, line) -> None:
    """None of these may run and say nothing (two identical faults must not count as one)."""
    done = epsim_here("run", "scale-up", *args)
    assert (done.returncode, done.stderr) == (2, f"epsim: error: {line}\n")


def test_a_rank_fault_may_name_a_rank_a_later_scale_up_starts(tmp_path) -> None:
    """Rank processes are numbered as they start and never reused: elastic-cycle's second scale-up starts 4 and 5,
    and the fault fails rank 5's registration only."""
    done = epsim_here("run", "elastic-cycle", "--fault", "nixl.register.fail:rank=5", "--json", "--out", str(tmp_path))
    assert done.returncode in (0, 1) and json.loads(done.stdout)["faults_fired"] == {"nixl.register.fail:rank=5": 1}
    records = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    crashes = [(r["pid"], r["error"]) for r in records if r["kind"] == "thread.crash"]
    assert crashes == [(5, "nixlBackendError: NIXL_ERR_BACKEND")]
    done = epsim_here("run", "elastic-cycle", "--fault", "nixl.register.fail:rank=6")
    assert done.returncode == 2 and "the scenario starts rank processes 0..5" in done.stderr


def test_check_determinism_under_a_random_hash_seed(monkeypatch) -> None:
    """PYTHONHASHSEED=random is a valid setting (no traceback); the rerun picks a fixed other seed."""
    monkeypatch.setenv("PYTHONHASHSEED", "random")
    done = epsim("run", "steady", "--check-determinism", timeout=120)
    assert done.returncode == 0 and "(same)" in done.stdout, done.stderr


def test_an_error_quoting_a_newline_stays_one_line(tmp_path) -> None:
    done = epsim_here("run", str(tmp_path / "no\nfile.yaml"))
    assert (done.returncode, done.stderr) == (2, f"epsim: error: {tmp_path}/no file.yaml: no such scenario file\n")


def test_a_conformance_run_that_overruns_is_one_error() -> None:
    """A conformance run's subprocess.TimeoutExpired is one error, not a traceback."""
    from sim import conform
    from sim.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="on fake NIXL did not finish within 0.01 s"):
        conform.run("fake", None, "dram", timeout_s=0.01)


def test_a_bug_in_the_engine_is_an_internal_error_not_a_verdict(monkeypatch) -> None:
    """An exception in epsim's own engine must not read as the code under test crashing (verdict crash, exit 1,
    and a sweep bundling it as a new failure): it is one line, exit 3; a sweep records an error row."""
    from sim.lab import sweep as sweep_mod
    from sim.eplb import policy

    def broken(*args, **kwargs):
        raise AttributeError("'ModelShape' object has no attribute 'num_expert_groups'")

    monkeypatch.setattr(policy, "rebalance", broken)
    done = epsim_here("run", "steady", "--json")
    assert done.returncode == 3 and not done.stdout.strip()
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("epsim: internal error: epsim's engine failed at ") and "not in the code under test" in line
    [spec] = sweep_mod.plan("steady", range(1), ["shared-agent"])
    row = sweep_mod.execute(spec)
    assert row["verdict"] == "error" and row["detail"].startswith("InternalError: epsim's engine failed")


def test_yaml_nested_past_the_parser_s_recursion_is_one_line(tmp_path) -> None:
    """A scenario file or a --set value nested a thousand deep must not end in a RecursionError's thousand-line
    traceback, with exit 1 (a verdict's code)."""
    deep = "[" * 5000 + "]" * 5000
    (tmp_path / "deep.yaml").write_text("description: " + deep + "\n")
    for args in (("run", str(tmp_path / "deep.yaml")), ("run", "steady", "--set", "description=" + deep)):
        done = epsim_here(*args)
        assert done.returncode == 2 and not done.stdout, done.stderr[-300:]
        [line] = done.stderr.strip().splitlines()
        assert line.endswith("nested too deeply)") or line.endswith("invalid YAML: nested too deeply"), line
        assert len(line) < 200  # the value is shortened, not echoed whole


def test_run_out_keeps_files_no_earlier_run_wrote(tmp_path) -> None:
    """--out does not replace a history.jsonl that is someone's own.  An earlier run's folder is still written
    again (its result.json says it is one)."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "history.jsonl").write_text("precious\n")
    done = epsim_here("run", "steady", "--out", str(own))
    assert done.returncode == 2 and not done.stdout
    [line] = done.stderr.strip().splitlines()
    assert line == (
        f"epsim: error: --out {own}: it holds history.jsonl, which no earlier epsim run wrote (no "
        "result.json of one); give a new or empty directory, or an earlier run's folder"
    )
    assert (own / "history.jsonl").read_text() == "precious\n"
    refused = tmp_path / "new" / "deeper"  # a run refused (or stopped with Ctrl-C) leaves no empty folder behind
    assert epsim_here("run", "no-such-scenario", "--out", str(refused)).returncode == 2
    assert not (tmp_path / "new").exists()
    earlier = tmp_path / "earlier"
    for _ in range(2):
        assert epsim_here("run", "steady", "--out", str(earlier)).returncode == 0
    assert json.loads((earlier / "result.json").read_text())["verdict"] == "pass"


def test_run_out_refuses_a_fifo_where_it_writes_a_file_instead_of_waiting_on_it(tmp_path) -> None:
    import os

    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "result.json")
    done = epsim("run", "steady", "--out", str(out), timeout=60)  # (a fresh interpreter: a hang fails the test)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"epsim: error: --out {out}: result.json there is not a regular file, where epsim writes a file of that name"
    ]


def test_a_bundle_whose_run_no_longer_matches_is_not_reproduced(tmp_path) -> None:
    """Replay compares the run with what the bundle recorded: a recorded trace hash the run does not give (the
    code under test changed, another numpy) is NOT reproduced, exit 1, with both hashes named."""
    import shutil

    b = tmp_path / "b"
    shutil.copytree("tests/corpus/broken-finalizer-gc-late", b)
    data = json.loads((b / "failure.json").read_text())
    recorded = data["outcome"]["trace_hash"]
    data["outcome"]["trace_hash"] = "0" * len(recorded)
    (b / "failure.json").write_text(json.dumps(data))
    done = epsim_here("replay", str(b), "--json")
    payload = json.loads(done.stdout)
    assert done.returncode == 1 and payload["reproduced"] is False
    assert payload["trace_hash"] == recorded and payload["expected_trace_hash"] == "0" * len(recorded)
    assert epsim_here("replay", "tests/corpus/broken-finalizer-gc-late").stdout.startswith("reproduced: ")


def test_a_replay_whose_files_cannot_be_written_prints_its_outcome_then_one_line(tmp_path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / ".trace.perfetto.json.part").mkdir()  # where the trace is written first: writing it fails (a full disk)
    done = epsim_here("replay", "tests/corpus/broken-finalizer-gc-late", "--out", str(out), "--json")
    assert done.returncode == 2 and json.loads(done.stdout)["reproduced"] is True
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"epsim: error: --out {out}: could not write the run's files") and line.endswith(
        "; the replay's outcome is printed above"
    ), line


def test_shrink_refuses_a_corpus_inside_the_bundle_it_shrinks(tmp_path) -> None:
    import shutil

    b = tmp_path / "corpus" / "found"
    shutil.copytree("tests/corpus/broken-finalizer-gc-late", b)
    before = sorted(p.name for p in b.iterdir())
    for corpus in (b, b / "sub"):
        done = epsim_here("shrink", str(b), "--out", str(tmp_path / "small"), "--corpus", str(corpus))
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [
            f"epsim: error: --corpus {corpus}: that is inside the bundle being shrunk; give the corpus folder that "
            f"holds bundles (such as {b.parent})"
        ]
    assert sorted(p.name for p in b.iterdir()) == before and not (tmp_path / "small").exists()


def test_json_nested_past_the_parser_s_depth_is_one_line(tmp_path) -> None:
    """A result.json, failure.json or tape.json of 1,200 nested lists: json raises RecursionError, not ValueError."""
    import shutil

    deep = "[" * 1200 + "]" * 1200
    out = tmp_path / "out"
    out.mkdir()
    (out / "result.json").write_text(deep)
    done = epsim_here("run", "steady", "--out", str(out))
    assert done.returncode == 2 and "it holds result.json, which no earlier epsim run wrote" in done.stderr
    for name, said in [
        ("failure.json", "nested deeper than a failure bundle ever is"),
        ("tape.json", "not a readable tape (nested deeper than a tape ever is)"),
    ]:
        b = tmp_path / name.replace(".", "-")
        shutil.copytree("tests/corpus/broken-finalizer-gc-late", b)
        (b / name).write_text(deep)
        done = epsim_here("replay", str(b))
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"epsim: error: {b / name}: {said}"]


def test_what_the_code_under_test_prints_stays_out_of_the_json(tmp_path, monkeypatch) -> None:
    """A strategy module that prints at import must not put its text on stdout (once per simulated process, before
    the JSON object), or `epsim run --json | jq` breaks."""
    (tmp_path / "chatty.py").write_text(
        "print('chatty strategy loaded')\nfrom sim.eplb.communicators.shared_agent import create\n"
    )
    monkeypatch.chdir(tmp_path)
    done = epsim_here("run", "steady", "--strategy", "chatty:create", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["verdict"] == "pass"
    assert "chatty strategy loaded" in done.stderr


def test_the_readable_summary_of_a_real_run_names_a_progress_delay_only_when_one_was_in_effect() -> None:
    from sim.run import Result
    from sim.cli_run import summary

    def real(delays) -> str:
        return summary(
            Result(
                "pass",
                None,
                None,
                0,
                "scale-up",
                "shared-agent",
                "real-cpu",
                "",
                10,
                1.0,
                2.0,
                metrics={"nixl_progress_delay_us": delays},
            )
        )

    assert "poll timeout" not in real([0]) and "poll timeout" not in real([])  # vLLM's own busy loop, or no rank
    assert real([1000]).splitlines()[-1] == (
        "NIXL progress threads: poll timeout 1000 us "
        "(EPSIM_NIXL_PROGRESS_DELAY_US; vLLM's own configuration busy-polls)"
    )
    assert "poll timeout 0, 1000 us" in real([0, 1000])  # torchrun slots on hosts set up differently


def test_scenarios_cuts_a_description_at_a_word_to_the_terminal_and_says_so() -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, COLUMNS="110")
    done = subprocess.run(
        [sys.executable, "-m", "sim.cli", "scenarios"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert lines and all(len(line) <= 110 for line in lines)
    cut = [line for line in lines if line.endswith(" ...")]
    assert cut, lines  # the built-in descriptions are longer than what is left of 110 columns
    for line in cut:  # whole words only: what comes before the mark is a prefix of the description at a space
        name, text = line.split()[0], line.split("steps  ", 1)[1][: -len(" ...")]
        full = {
            r["name"]: r["description"]
            for r in json.loads(
                subprocess.run(
                    [sys.executable, "-m", "sim.cli", "scenarios", "--json"], capture_output=True, text=True, timeout=60
                ).stdout
            )
        }[name]
        assert full.startswith(text) and full[len(text)] == " "


def test_a_typo_in_a_scenario_key_says_what_it_meant_even_among_other_errors(tmp_path) -> None:
    from sim.scenario import builtin_dir

    text = (builtin_dir() / "steady.yaml").read_text()
    (tmp_path / "typo.yaml").write_text(text.replace("\nsteps:", "\nstepz:").replace("\nranks:", "\nrankz:"))
    done = epsim("run", str(tmp_path / "typo.yaml"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "unknown key; did you mean 'ranks'?" in done.stderr and "more error" in done.stderr


def test_a_misspelt_fault_site_and_a_function_that_is_no_factory_are_named_as_such() -> None:
    done = epsim("run", "steady", "--fault", "gc.lat:delay_s=1")
    assert done.returncode == 2 and "fault site 'gc.lat' not found; did you mean 'gc.late'?" in done.stderr
    done = epsim("run", "steady", "--strategy", "os:getcwd")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("epsim: error: strategy 'os:getcwd' is not a strategy factory: getcwd()")


def test_hints_name_the_command_the_user_typed(tmp_path) -> None:
    """./dev says how it was run (EPSIM_PROG): the replay and report hints use it; without it, `epsim`."""
    import os
    import subprocess
    import sys

    db = tmp_path / "h.db"
    for env, want in (({"EPSIM_PROG": "./dev epsim"}, "./dev epsim"), ({}, "epsim")):
        db.unlink(missing_ok=True)
        done = subprocess.run(
            [sys.executable, "-m", "sim.cli", "sweep", "rank-failure", "--seeds", "0:1", "--db", str(db)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**{k: v for k, v in os.environ.items() if k != "EPSIM_PROG"}, **env},
        )
        assert done.returncode == 0, done.stderr
        assert f": {want} replay " in done.stdout and f"summary: {want} report " in done.stdout
