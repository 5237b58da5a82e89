"""sim.scenario: the built-in library, round trips, one-line errors for bad files, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim import scenario as S
from sim.errors import ScenarioError

BUILTINS = ["abort", "deepseek-v3-ep64", "elastic-cycle", "rank-failure", "scale-down", "scale-up", "steady"]

SMALL = """\
name: small
ranks: 2
max_ranks: 4
model: {layers: 4, experts: 8, local_experts: 4, nominal_expert_bytes: 1024}
eplb: {step_interval: 500, window: 200}
timeline:
  - {at_step: 1000, kind: scale_up, to: 4}
  - {at_step: 2000, kind: scale_down, to: 2}
steps: 3000
"""


def write(tmp_path: Path, text: str, name: str = "x.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(source: str) -> str:
    with pytest.raises(ScenarioError) as info:
        S.load(source)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# -- the built-in library --------------------------------------------------------------------------------------


def test_builtin_names():
    assert S.builtin_names() == BUILTINS


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_loads_and_names_itself(name):
    s = S.load(name)
    assert s.name == name
    assert s.description
    assert all(s.model.local_experts * size >= s.model.experts for size in s.ep_sizes())
    assert S.load(str(S.builtin_dir() / f"{name}.yaml")) == s  # by path too


@pytest.mark.parametrize(
    "name,sizes",
    [
        ("steady", [2]),
        ("scale-up", [2, 4]),
        ("scale-down", [4, 2]),
        ("elastic-cycle", [2, 4, 2, 4]),
        ("rank-failure", [4, 3]),
        ("abort", [2, 4]),
        ("deepseek-v3-ep64", [64, 72, 64, 80, 64]),
    ],
)
def test_builtin_ep_sizes(name, sizes):
    assert S.load(name).ep_sizes() == sizes


def test_small_builtins_are_small():
    for name in BUILTINS:
        s = S.load(name)
        if name != "deepseek-v3-ep64":
            assert s.steps <= 5000 and s.model.layers <= 4 and s.peak_ranks() <= 4, name


def test_deepseek_numbers():
    s = S.load("deepseek-v3-ep64")
    assert (s.model.layers, s.model.experts, s.ranks, s.max_ranks) == (58, 256, 64, 80)
    assert s.model.nominal_expert_bytes == 42 * 2**20
    assert s.steps * s.serving.step_time_s == pytest.approx(3600.0)
    assert s.eplb.step_interval == 3000 and s.eplb.first_rebalance_step == 750
    assert len(s.timeline) == 4 and s.peak_ranks() == 80


def test_abort_and_failure_semantics():
    a = S.load("abort")
    assert [e.kind for e in a.timeline] == ["abort", "scale_up"]
    assert a.ep_schedule() == [(0, 2), (1600, 4)]
    assert a.peak_ranks() == 4
    r = S.load("rank-failure")
    assert r.timeline[0].rank == 3 and r.ep_schedule() == [(0, 4), (1000, 3)]


# -- round trip and defaults -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
def test_dump_load_round_trip(name, tmp_path):
    s = S.load(name)
    path = s.dump(tmp_path / "bundle" / "scenario.yaml")
    again = S.load(str(path))
    assert again == s
    assert again.to_yaml() == s.to_yaml() == S.to_yaml(s)


def test_round_trip_with_faults(tmp_path):
    s = S.with_overrides(
        S.load("scale-up"),
        faults=[
            {"site": "nixl.xfer.fail_after", "params": {"polls": 3, "error": "REMOTE_DISCONNECT"}, "at_step": 1000},
            {"site": "nixl.xfer.late", "params": {"delay": 0.5}, "times": 2},
        ],
    )
    again = S.load(str(S.dump(s, tmp_path / "s.yaml")))
    assert again == s
    assert again.faults[1].params == {"delay": 0.5} and type(again.faults[1].params["delay"]) is float
    assert type(again.faults[0].params["polls"]) is int
    # a boolean stays one (no site takes one yet: the shape alone is checked here)
    assert type(S.FaultSpec(site="x", params={"strict": True}).params["strict"]) is bool


@pytest.mark.parametrize(
    "fault, line",
    [
        ("{site: nope}", "faults[0]: fault site 'nope' not found"),
        (
            "{site: gc.late, params: {rank: 99}}",
            "faults[0]: fault gc.late:rank=99: rank 99 never exists; the scenario starts rank processes 0..3",
        ),
        (
            "{site: gc.late, params: {at_step: 99999}}",
            "faults[0]: fault gc.late:at_step=99999: at_step 99999 is not before the scenario's steps = 3000",
        ),
        (
            "{site: gc.late, at_step: 5, params: {at_step: 99}}",
            "faults[0].params.at_step: 99 disagrees with faults[0].at_step = 5; give it once",
        ),
        ("{site: gc.late, params: {bogus: 1}}", "faults[0]: fault gc.late: no parameter 'bogus'"),
    ],
)
def test_a_scenario_s_own_faults_are_checked_as_fault_options_are(tmp_path, fault, line):
    """A scenario file's faults are checked as fault options are, not only when armed: the error names the file and
    the fault's place, and each is checked against the scenario (a rank that never exists does not pass silently)."""
    path = write(tmp_path, SMALL + f"faults:\n  - {fault}\n")
    assert error_of(path).startswith(f"{path}: {line}")


def test_numbers_in_exponent_form_are_numbers(tmp_path):
    """PyYAML reads 5e-2 as a string (YAML 1.1 floats need a dot); scenario files and --set read it as a number."""
    path = write(tmp_path, SMALL + "serving: {step_time_s: 5e-2}\n")
    assert S.load(path).serving.step_time_s == 0.05
    assert S.load_value("1e6") == 1e6 and S.load_value("abc") == "abc"


def test_more_routed_tokens_than_one_draw_holds_is_one_line(tmp_path):
    path = write(tmp_path, SMALL + "serving: {tokens_per_step: 10000000000000000}\n")
    assert error_of(path).startswith(f"{path}: serving.tokens_per_step: 10000000000000000 tokens x top_k 8")


def test_defaults(tmp_path):
    s = S.load(write(tmp_path, SMALL))
    assert s.description == "" and s.profile == "dram" and s.strategy == "shared-agent"
    assert s.seed == 0 and s.collective_timeout_s == 300.0 and s.faults == []
    assert (s.model.hidden, s.model.tensors_per_layer) == (4, 2)
    assert (s.eplb.use_async, s.eplb.first_rebalance_step) == (False, 125)
    assert (s.serving.step_time_s, s.serving.tokens_per_step, s.serving.top_k) == (0.05, 256, 8)
    assert (s.serving.skew, s.serving.drift_every_steps) == (1.2, 0)
    assert s.timeline[0].prepare_s == 1.0
    assert s.ep_sizes() == [2, 4, 2]


def test_host_ahead_follows_async_scheduling_unless_given(tmp_path):
    """vLLM's async scheduling (on by default) leaves a step's forward work queued when EPLB runs: one step; without
    it, none; a value given stays, whatever async_scheduling becomes, and a derived one is derived again."""
    s = S.load(write(tmp_path, SMALL))
    assert (s.serving.async_scheduling, s.serving.host_ahead_steps) == (True, 1.0)
    off = S.with_overrides(s, **{"serving.async_scheduling": False})
    assert off.serving.host_ahead_steps == 0.0
    assert S.with_overrides(off, **{"serving.async_scheduling": True}).serving.host_ahead_steps == 1.0
    given = S.with_overrides(off, **{"serving.host_ahead_steps": 0.25})
    assert S.with_overrides(given, **{"serving.async_scheduling": True}).serving.host_ahead_steps == 0.25


def test_first_rebalance_step_explicit(tmp_path):
    s = S.load(write(tmp_path, SMALL.replace("window: 200}", "window: 200, first_rebalance_step: 7}")))
    assert s.eplb.first_rebalance_step == 7


# -- bad files: exactly one line naming the file and the field -------------------------------------------------


def test_unknown_key(tmp_path):
    path = write(tmp_path, SMALL + "stpes: 4\n")
    assert error_of(path) == f"{path}: stpes: unknown key; did you mean 'steps'?"


def test_unknown_nested_key(tmp_path):
    path = write(tmp_path, SMALL.replace("window: 200}", "window: 200, bogus: 1}"))
    message = error_of(path)
    assert message.startswith(f"{path}: eplb.bogus: unknown key (allowed: step_interval, window")


def test_unknown_key_in_event(tmp_path):
    path = write(tmp_path, SMALL.replace("kind: scale_up, to: 4}", "kind: scale_up, to: 4, rnak: 1}"))
    assert error_of(path) == f"{path}: timeline[0].rnak: unknown key; did you mean 'rank'?"


def test_wrong_type(tmp_path):
    path = write(tmp_path, SMALL.replace("layers: 4", "layers: four"))
    assert error_of(path) == f"{path}: model.layers: Input should be a valid integer"


@pytest.mark.parametrize(
    "old,new,field",
    [
        ("ranks: 2", "ranks: '2'", "ranks"),  # strings are not coerced
        ("layers: 4", "layers: true", "model.layers"),  # nor booleans
        ("steps: 3000", "steps: 3000.5", "steps"),
        ("kind: scale_up", "kind: grow", "timeline[0].kind"),
        ("ranks: 2", "ranks: 0", "ranks"),
        ("at_step: 1000", "at_step: -1", "timeline[0].at_step"),
        ("ranks: 2", "ranks: 2\ngpus_per_node: 0", "gpus_per_node"),
        ("experts: 8,", "experts: 8, expert_groups: 3,", "model.expert_groups"),  # groups must split the experts
    ],
)
def test_bad_values(tmp_path, old, new, field):
    path = write(tmp_path, SMALL.replace(old, new, 1))
    assert error_of(path).startswith(f"{path}: {field}: ")


def test_missing_required_field(tmp_path):
    path = write(tmp_path, SMALL.replace("steps: 3000\n", ""))
    assert error_of(path) == f"{path}: steps: Field required"


def test_several_errors_stay_one_line(tmp_path):
    path = write(tmp_path, SMALL.replace("layers: 4", "layers: x").replace("ranks: 2", "ranks: y"))
    message = error_of(path)
    assert message.startswith(f"{path}: ranks: ") and message.endswith("(and 1 more error)")


@pytest.mark.parametrize(
    "timeline,expected",
    [
        (
            "  - {at_step: 1000, kind: scale_down, to: 5}\n",
            "timeline[0].to: scale_down to 5 ranks but only 2 exist at step 1000; scale_down must decrease the EP size",
        ),
        (
            "  - {at_step: 1000, kind: scale_up, to: 4}\n  - {at_step: 2000, kind: scale_down, to: 5}\n",
            "timeline[1].to: scale_down to 5 ranks but only 4 exist at step 2000; scale_down must decrease the EP size",
        ),
        (
            "  - {at_step: 1000, kind: scale_up, to: 2}\n",
            "timeline[0].to: scale_up to 2 ranks but 2 already exist at step 1000; scale_up must increase the EP size",
        ),
        (
            "  - {at_step: 1000, kind: scale_down, to: 1}\n",
            "timeline[0].to: scale_down to 1 rank x 4 local_experts = 4 physical slots, fewer than model.experts = 8",
        ),
        ("  - {at_step: 1000, kind: scale_up, to: 6}\n", "timeline[0].to: scale_up to 6 ranks exceeds max_ranks = 4"),
        ("  - {at_step: 1000, kind: abort, to: 6}\n", "timeline[0].to: abort to 6 ranks exceeds max_ranks = 4"),
        (
            "  - {at_step: 1000, kind: abort, to: 2}\n",
            "timeline[0].to: abort of a reconfiguration to 2 ranks but 2 already exist at step 1000; "
            "the prepared size must differ",
        ),
        (
            "  - {at_step: 2000, kind: scale_up, to: 4}\n  - {at_step: 1000, kind: scale_down, to: 2}\n",
            "timeline[1].at_step: 1000 comes before timeline[0].at_step = 2000; events must be sorted by at_step",
        ),
        ("  - {at_step: 3000, kind: scale_up, to: 4}\n", "timeline[0].at_step: 3000 is not before steps = 3000"),
        (
            "  - {at_step: 1000, kind: fail_rank, rank: 2}\n",
            "timeline[0].rank: fail_rank of rank 2 but only ranks 0..1 exist at step 1000",
        ),
        (
            "  - {at_step: 1000, kind: fail_rank, rank: 1}\n",
            "timeline[0].rank: after rank 1 fails, 1 rank x 4 local_experts = 4 physical slots, "
            "fewer than model.experts = 8",
        ),
        ("  - {at_step: 1000, kind: scale_up}\n", "timeline[0].to: scale_up needs the new EP size"),
        ("  - {at_step: 1000, kind: fail_rank}\n", "timeline[0].rank: fail_rank needs the rank that fails"),
        (
            "  - {at_step: 1000, kind: fail_rank, rank: 0, to: 1}\n",
            "timeline[0].to: fail_rank takes rank, not to (the EP size drops by one)",
        ),
        (
            "  - {at_step: 1000, kind: scale_up, to: 4, rank: 1}\n",
            "timeline[0].rank: only fail_rank takes a rank, not scale_up",
        ),
    ],
)
def test_impossible_timelines(tmp_path, timeline, expected):
    head, _, _ = SMALL.partition("timeline:\n")
    path = write(tmp_path, head + "timeline:\n" + timeline + "steps: 3000\n")
    assert error_of(path) == f"{path}: {expected}"


def test_an_abort_needs_the_revision_whose_workers_take_it(tmp_path):
    """vLLM 0.33.0 (the default lifecycle) has only the external coordinator's abort, which reaches no worker."""
    head, _, _ = SMALL.partition("timeline:\n")
    text = head + "timeline:\n  - {at_step: 1000, kind: abort, to: 4}\nsteps: 3000\n"
    path = write(tmp_path, text)
    assert error_of(path) == (
        f"{path}: timeline[0].kind: vLLM 0.33.0's workers take no ABORT; an abort needs lifecycle: pr-53947"
    )
    assert S.load(write(tmp_path, text + "lifecycle: pr-53947\n")).lifecycle == "pr-53947"
    assert S.load("abort").lifecycle == "pr-53947" and S.load("scale-up").lifecycle == "0.33.0"


def test_fail_rank_after_scale_up(tmp_path):
    head, _, _ = SMALL.partition("timeline:\n")
    text = head + (
        "timeline:\n  - {at_step: 1000, kind: scale_up, to: 4}\n"
        "  - {at_step: 1500, kind: fail_rank, rank: 3}\nsteps: 3000\n"
    )
    assert S.load(write(tmp_path, text)).ep_sizes() == [2, 4, 3]


@pytest.mark.parametrize(
    "old,new,expected",
    [
        (
            "local_experts: 4",
            "local_experts: 3",
            "ranks: 2 ranks x 3 local_experts = 6 physical slots, fewer than model.experts = 8",
        ),
        ("max_ranks: 4", "max_ranks: 1", "max_ranks: 1 is below ranks = 2"),
        ("eplb: {", "serving: {top_k: 9}\neplb: {", "serving.top_k: 9 exceeds model.experts = 8"),
    ],
)
def test_impossible_shapes(tmp_path, old, new, expected):
    path = write(tmp_path, SMALL.replace(old, new, 1))
    assert error_of(path) == f"{path}: {expected}"


def test_fault_shape(tmp_path):
    path = write(tmp_path, SMALL + "faults:\n  - {site: nixl.xfer.stuck, params: {x: [1, 2]}}\n")
    assert error_of(path) == (
        f"{path}: faults[0].params.x: a fault parameter is a boolean, integer, number or string, not list"
    )
    path = write(tmp_path, SMALL + "faults:\n  - {site: nixl.xfer.stuck, at_step: 9000}\n")
    assert error_of(path) == f"{path}: faults[0].at_step: 9000 is not before steps = 3000"
    path = write(tmp_path, SMALL + "faults:\n  - {site: nixl.xfer.stuck, times: 0}\n")
    assert error_of(path).startswith(f"{path}: faults[0].times: ")
    path = write(tmp_path, SMALL + "faults:\n  - {params: {}}\n")
    assert error_of(path) == f"{path}: faults[0].site: Field required"


def test_malformed_yaml(tmp_path):
    path = write(tmp_path, "name: x\nmodel: {layers: 4\nranks: 2\n")
    message = error_of(path)
    assert message.startswith(f"{path}:") and "invalid YAML" in message


def test_tab_indented_yaml(tmp_path):
    path = write(tmp_path, "name: x\nmodel:\n\tlayers: 4\n")
    assert error_of(path).startswith(f"{path}:3:")


def test_duplicate_key(tmp_path):
    path = write(tmp_path, SMALL + "ranks: 3\n")
    assert error_of(path) == f"{path}:10:1: invalid YAML: duplicate key 'ranks'"


def test_anchors_and_merge_keys_are_not_duplicates(tmp_path):
    old = "timeline:\n  - {at_step: 1000, kind: scale_up, to: 4}\n  - {at_step: 2000, kind: scale_down, to: 2}\n"
    text = SMALL.replace(
        old,
        "timeline:\n  - &up {at_step: 1000, kind: scale_up, to: 4, prepare_s: 2.0}\n"
        "  - {<<: *up, at_step: 2000, kind: scale_down, to: 2}\n",
    )
    s = S.load(write(tmp_path, text))
    assert s.ep_sizes() == [2, 4, 2] and s.timeline[1].prepare_s == 2.0


@pytest.mark.parametrize("text,what", [("", "empty"), ("- 1\n- 2\n", "a list"), ("just text\n", "a str")])
def test_top_level_not_a_mapping(tmp_path, text, what):
    path = write(tmp_path, text)
    assert error_of(path) == f"{path}: the top level must be a mapping of scenario fields, not {what}"


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    assert error_of(path) == f"{path}: no such scenario file"


def test_directory(tmp_path):
    (tmp_path / "d.yaml").mkdir()
    path = str(tmp_path / "d.yaml")
    assert error_of(path) == f"{path}: is a directory, not a scenario file"


def test_unknown_name_lists_builtins():
    message = error_of("scale-upp")
    assert message.startswith("unknown scenario 'scale-upp': did you mean 'scale-up'?")
    assert all(name in message for name in BUILTINS)
    message = error_of("zzz")
    assert "built-ins are " + ", ".join(BUILTINS) in message


def test_errors_are_value_errors(tmp_path):
    with pytest.raises(ValueError):
        S.load("zzz")


def test_builtin_error_names_builtin_file(tmp_path, monkeypatch):
    broken = tmp_path / "lib"
    broken.mkdir()
    (broken / "bad.yaml").write_text(SMALL.replace("layers: 4", "layers: four"))
    monkeypatch.setenv("EPSIM_SCENARIO_DIR", str(broken))
    assert S.builtin_names() == ["bad"]
    # the file's real path: "scenarios/bad.yaml" would send the reader to the repository's folder
    assert error_of("bad") == f"{broken / 'bad.yaml'}: model.layers: Input should be a valid integer"


def test_file_without_suffix_by_name(tmp_path, monkeypatch):
    (tmp_path / "mine").write_text(SMALL)
    monkeypatch.chdir(tmp_path)
    assert S.load("mine").name == "small"


def test_from_dict():
    s = S.load("scale-up")
    assert S.from_dict(s.model_dump()) == s
    with pytest.raises(ScenarioError, match=r"^scenario: steps: Field required$"):
        data = s.model_dump()
        del data["steps"]
        S.from_dict(data)


# -- with_overrides --------------------------------------------------------------------------------------------


def test_with_overrides_top_level_and_nested():
    s = S.load("scale-up")
    t = S.with_overrides(
        s, seed=7, strategy="arena-registry", eplb={"window": 50}, serving__skew=0.8, **{"model.hidden": 16}
    )
    assert (t.seed, t.strategy, t.eplb.window, t.serving.skew, t.model.hidden) == (7, "arena-registry", 50, 0.8, 16)
    assert t.eplb.step_interval == s.eplb.step_interval and t.serving.top_k == s.serving.top_k  # merged, kept
    assert s.seed == 0 and s.eplb.window == 200  # the original is unchanged


def test_with_overrides_rederives_first_rebalance_step():
    s = S.load("scale-up")
    assert S.with_overrides(s, eplb={"step_interval": 400}).eplb.first_rebalance_step == 100
    explicit = S.with_overrides(s, eplb={"first_rebalance_step": 10})
    assert S.with_overrides(explicit, eplb__step_interval=400).eplb.first_rebalance_step == 10


def test_with_overrides_replaces_lists_and_accepts_models():
    s = S.load("scale-up")
    t = S.with_overrides(s, timeline=[S.Event(at_step=500, kind="scale_up", to=3)])
    assert t.ep_sizes() == [2, 3]
    assert S.with_overrides(s, timeline=[]).ep_sizes() == [2]
    assert S.with_overrides(s, model=s.model.model_copy(update={"hidden": 8})).model.hidden == 8


def test_with_overrides_revalidates():
    s = S.load("scale-up")
    with pytest.raises(ScenarioError) as info:
        S.with_overrides(s, max_ranks=3)
    assert str(info.value) == "scale-up (with overrides): timeline[0].to: scale_up to 4 ranks exceeds max_ranks = 3"
    with pytest.raises(ScenarioError, match=r"^scale-up \(with overrides\): stpes: unknown key; did you mean"):
        S.with_overrides(s, stpes=10)
    with pytest.raises(ScenarioError, match=r"^scale-up \(with overrides\): eplb.window: Input should be"):
        S.with_overrides(s, eplb__window="big")
    with pytest.raises(ScenarioError, match=r"override seed.x: seed is not a mapping"):
        S.with_overrides(s, **{"seed.x": 1})
    with pytest.raises(ScenarioError, match=r"timeline\[0\].at_step: 3000 is not before steps = 900"):
        S.with_overrides(s, steps=900, timeline=[{"at_step": 3000, "kind": "scale_up", "to": 4}])
