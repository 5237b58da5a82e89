"""Crash verdicts: the exception chain and the frames of the code under test, in --json, --out, the human output
and bundles; sweep signatures that tell root causes apart; bundles of such crashes replay and shrink."""

from __future__ import annotations

import json
from pathlib import Path

from sim import crash
from sim.lab import bundle, shrink
from sim.lab import sweep as sweep_mod
from sim.run import run_scenario, same_signature
from sim.scenario import load
from tests.conftest import epsim_here

WRAPPED = "tests.strategies.wrapped_errors:create"  # RuntimeError <- RuntimeError <- nixlNotFoundError
BAD_LAYOUT = "tests.strategies.wrapped_errors:create_bad_layout"  # RuntimeError <- RuntimeError <- ValueError
OUTER = "Failed to initialize NixlEplbCommunicator (NIXL EPLB init failed: buffers)"


def test_a_wrapped_crash_gives_its_chain_and_frames_in_json_out_and_text(tmp_path: Path) -> None:
    done = epsim_here("run", "steady", "--strategy", WRAPPED, "--json", "--out", str(tmp_path))
    assert done.returncode == 1, done.stderr
    r = json.loads(done.stdout)
    assert r["verdict"] == "crash" and r["invariant"] == "exception"
    c = r["crash"]
    assert [(link["type"], link["message"], link["via"]) for link in c["chain"]] == [
        ("RuntimeError", OUTER, None),
        ("RuntimeError", "NIXL EPLB init failed: buffers", "cause"),
        ("nixlNotFoundError", "NIXL_ERR_NOT_FOUND", "cause"),
    ]
    assert r["detail"].endswith(f"RuntimeError: {OUTER} <- nixlNotFoundError: NIXL_ERR_NOT_FOUND")
    assert c["thread"] in r["detail"] and f"(pid {c['pid']})" in r["detail"]
    # the frames the root cause was raised through: the strategy's, innermost last, relative to the working
    # directory; the simulation's and the fake NIXL's own frames are left out (and counted)
    ours = [(f["file"], f["function"]) for f in c["frames"]]
    assert ours == [
        ("tests/strategies/wrapped_errors.py", "create"),
        ("tests/strategies/wrapped_errors.py", "NixlEplbCommunicator.__init__"),
        ("tests/strategies/wrapped_errors.py", "NixlEplbCommunicator._init_buffers"),
        ("tests/strategies/wrapped_errors.py", "_connect_peers"),
    ]
    inner = c["frames"][-1]
    assert inner["kind"] == "code" and inner["code"].startswith('agent.make_connection("eplb-no-such-peer")')
    source = Path("tests/strategies/wrapped_errors.py").read_text().splitlines()
    assert source[inner["line"] - 1].strip() == inner["code"]
    assert c["frames_omitted"]["harness"] > 0 and c["origin"] == "_connect_peers"
    assert r["signature"] == f"exception:RuntimeError<-nixlNotFoundError@_connect_peers|{WRAPPED}|-"
    # --out: result.json is the same object; the history keeps the one line it always kept (no frames, no line
    # numbers: the trace hash does not move when the file is edited)
    assert json.loads((tmp_path / "result.json").read_text())["crash"] == c
    records = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    crashes = [x for x in records if x["kind"] == "thread.crash"]
    assert crashes and all(set(x) == {"t", "kind", "thread", "pid", "error"} for x in crashes)
    assert crashes[0]["thread"] == c["thread"] and crashes[0]["error"] == f"RuntimeError: {OUTER}"
    # the human output: the chain, then where it was raised
    text = epsim_here("run", "steady", "--strategy", WRAPPED).stdout
    assert "<- cause: RuntimeError: NIXL EPLB init failed: buffers" in text
    assert "tests/strategies/wrapped_errors.py:" in text and "in _connect_peers: agent.make_connection(" in text


def test_other_verdicts_have_no_crash_data() -> None:
    r = run_scenario(load("steady"), strategy="shared-agent")
    assert r.verdict == "pass" and r.crash is None and r.to_dict()["crash"] is None


def test_two_crashes_with_the_same_outer_type_and_different_root_causes_have_different_signatures() -> None:
    rows = [sweep_mod.execute(spec) for spec in sweep_mod.plan("steady", range(2), [WRAPPED, BAD_LAYOUT])]
    sigs = {(row["strategy"], row["signature"]) for row in rows}
    assert all(row["verdict"] == "crash" for row in rows)
    # one signature per strategy whatever the seed (the function is the same on every seed), two in all
    assert sigs == {
        (WRAPPED, f"exception:RuntimeError<-nixlNotFoundError@_connect_peers|{WRAPPED}|-"),
        (BAD_LAYOUT, f"exception:RuntimeError<-ValueError@_check_layout|{BAD_LAYOUT}|-"),
    }
    assert all(" <- " in row["detail"] for row in rows)


def test_a_bundle_of_a_wrapped_crash_replays_and_shrinks(tmp_path: Path) -> None:
    [spec] = sweep_mod.plan("steady", range(1), [BAD_LAYOUT])
    row = sweep_mod.execute(spec)
    path = bundle.write(spec, row, tmp_path / "bundles")
    assert (
        path.name == f"exception_RuntimeError-from-ValueError-in-_check_layout__{BAD_LAYOUT.replace(':', '_')}"
        f"__nofault-seed0"
    )
    data = json.loads((path / "failure.json").read_text())
    assert "nondeterministic" not in data
    assert data["outcome"]["signature"] == row["signature"]
    assert data["outcome"]["crash"]["chain"][-1]["type"] == "ValueError"
    rep = bundle.replay(path)
    assert rep.reproduced and rep.result.crash == data["outcome"]["crash"]
    done = epsim_here("replay", str(path), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["reproduced"], done.stdout
    res = shrink.shrink(path, tmp_path / "small", max_runs=20)
    assert res.bundle is not None
    assert bundle.load(res.bundle).expected["signature"] == row["signature"]


def test_a_bundle_stored_before_signatures_named_the_root_cause_still_replays(tmp_path: Path) -> None:
    [spec] = sweep_mod.plan("steady", range(1), [WRAPPED])
    row = sweep_mod.execute(spec)
    path = bundle.write(spec, row, tmp_path)
    data = json.loads((path / "failure.json").read_text())
    data["outcome"]["signature"] = f"exception:RuntimeError|{WRAPPED}|-"  # as epsim wrote it before
    (path / "failure.json").write_text(json.dumps(data))
    assert bundle.replay(path).reproduced
    assert shrink.shrink(path, tmp_path / "small", max_runs=5).bundle is not None
    assert not same_signature(f"exception:ValueError|{WRAPPED}|-", row["signature"])
    assert not same_signature(f"exception:RuntimeError<-ValueError|{WRAPPED}|-", row["signature"])
    assert not same_signature(f"exception:RuntimeError|{WRAPPED}|gc.late", row["signature"])
    assert same_signature(None, None) and not same_signature("stale_peer|x|-", "leak|x|-")


# -- sim.crash on exceptions made here ---------------------------------------------------------------------------
def _raise(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("did not raise")


def test_describe_walks_context_and_stops_at_a_suppressed_one() -> None:
    empty: dict[str, str] = {}

    def handling():
        try:
            empty["missing"]
        except KeyError:
            raise TypeError("bad handler")  # noqa: B904 - raised while handling, on purpose: the chain under test

    c = crash.describe(_raise(handling))
    assert [(x["type"], x["via"]) for x in c["chain"]] == [("TypeError", None), ("KeyError", "context")]
    assert c["origin"] == "test_describe_walks_context_and_stops_at_a_suppressed_one.<locals>.handling"

    def suppressed():
        try:
            empty["missing"]
        except KeyError:
            raise TypeError("clean") from None

    assert [x["type"] for x in crash.describe(_raise(suppressed))["chain"]] == ["TypeError"]
    assert crash.line(crash.describe(_raise(handling))) == "TypeError: bad handler <- KeyError: 'missing'"


def test_describe_keeps_the_innermost_frames_and_no_addresses() -> None:
    def deep(n):
        if n == 0:
            raise ValueError(f"bad {object()!r}")
        deep(n - 1)

    c = crash.describe(_raise(lambda: deep(30)))
    assert len(c["frames"]) == crash.MAX_FRAMES and c["frames_omitted"]["outer"] > 0
    assert c["frames"][-1]["code"] == 'raise ValueError(f"bad {object()!r}")'
    assert "0x…" in c["chain"][0]["message"] and "0x7" not in c["chain"][0]["message"]
    assert all(f["file"] == "tests/sim/test_crash_verdicts.py" for f in c["frames"])
    json.dumps(c)  # plain data: it crosses the real backend's pipe and goes into result.json


def test_frames_are_placed_as_harness_library_or_code_with_comparable_paths(tmp_path: Path) -> None:
    root = Path(crash.__file__).resolve().parent.parent
    assert crash._place(str(root / "sim" / "kernel.py"))[0] == "harness"
    assert crash._place(str(root / "fakes" / "nixl" / "_api.py"))[0] == "harness"
    assert crash._place(str(root / "sim" / "vllm" / "loader.py"))[0] == "harness"  # loads vLLM; not vLLM
    assert crash._place(str(root / "sim" / "eplb" / "communicators" / "plugins.py"))[0] == "harness"
    assert crash._place(str(root / "sim" / "eplb" / "communicators" / "per_agent.py"))[0] == "code"
    import json as stdlib_json
    import threading

    assert crash._place(stdlib_json.__file__)[0] == "library" and crash._place(threading.__file__)[0] == "harness"
    # vLLM's sources in epsim's cache (or a source tree): shown from their package on, as any machine has them
    cached = tmp_path / "cache" / "vllm-0.33.0" / "vllm" / "distributed" / "eplb" / "eplb_communicator.py"
    assert crash._place(str(cached)) == ("code", "vllm/distributed/eplb/eplb_communicator.py")
