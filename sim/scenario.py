"""Scenarios: the validated description of one run, loaded from YAML, and the built-in library in ``scenarios/``.

A scenario says what is deployed (model shape, EP size), how it serves (step time, routing skew), when EPLB
rebalances, what happens to the group over time (the *timeline*: scale up, scale down, an aborted reconfiguration, a
rank failure), which faults are armed, and which strategy and hardware profile run it::

    from sim import scenario
    s = scenario.load("elastic-cycle")            # a built-in name ...
    s = scenario.load("my/run.yaml")              # ... or a file
    s.ep_sizes()                                  # [2, 4, 2, 4]
    s2 = scenario.with_overrides(s, seed=7, eplb={"step_interval": 400})
    s2.dump(bundle / "scenario.yaml")

Every model forbids unknown keys, and YAML values are taken strictly (``"4"`` is not an integer, ``true`` is not a
number).  Every problem (a YAML syntax error, a missing file, a wrong type, a timeline that removes more ranks than
exist) is one :class:`~sim.errors.ScenarioError` line naming the file and the field, for example
``scenarios/x.yaml: timeline[1].to: scale_down to 5 ranks but only 4 exist at step 2000``.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ScenarioError
from .errors import one_line as _one_line

__all__ = [
    "ModelConfig",
    "EplbConfig",
    "ServingConfig",
    "Event",
    "FaultSpec",
    "Scenario",
    "load",
    "from_dict",
    "builtin_names",
    "builtin_dir",
    "with_overrides",
    "to_yaml",
    "dump",
]

# Where the built-in scenario files live: ``scenarios/`` beside the ``sim`` package, which is the repository root
# in a source checkout and in an editable install.  EPSIM_SCENARIO_DIR points elsewhere (a wheel install ships no
# ``scenarios/``).
_REPO_SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"
_SUFFIXES = (".yaml", ".yml")


def builtin_dir() -> Path:
    """The folder of built-in scenario files (``EPSIM_SCENARIO_DIR`` if set, else ``scenarios/`` in the repo)."""
    env = os.environ.get("EPSIM_SCENARIO_DIR")
    return Path(env) if env else _REPO_SCENARIOS


def builtin_names() -> list[str]:
    """Names of the built-in scenarios, sorted."""
    d = builtin_dir()
    if not d.is_dir():
        return []
    return sorted(p.stem for p in d.iterdir() if p.suffix == ".yaml" and p.is_file())


# --------------------------------------------------------------------------------------------------------------
# Schema


MAX_RANKS = 4096  # EP sizes; the largest elastic EP deployments are a few hundred ranks
MAX_ELEMENTS = 2**28  # float32 elements of every rank's simulated expert weights and buffers together (1 GiB)


class _Problem(ValueError):
    """A cross-field problem at ``path`` (relative to the model that raises it), reported as ``path: message``."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


class _Strict(BaseModel):
    # allow_inf_nan: a NaN or an infinity is "not a finite number", not "out of range" (which NaN never is)
    model_config = ConfigDict(extra="forbid", strict=True, frozen=False, allow_inf_nan=False)


class ModelConfig(_Strict):
    """The MoE model as the simulation sees it: small real tensors, nominal sizes for the time model."""

    # Upper bounds far above any model served today; beyond them a run would exhaust memory or never end.
    layers: int = Field(ge=1, le=4096, description="MoE layers")
    experts: int = Field(ge=1, le=65536, description="logical (routed) experts per layer")
    local_experts: int = Field(ge=1, le=4096, description="physical expert slots per rank; constant across EP sizes")
    hidden: int = Field(
        4,
        ge=1,
        le=2**24,
        description="elements per expert row in the small real tensors (epsim calibrate moves 1 MiB rows)",
    )
    tensors_per_layer: int = Field(2, ge=1, le=64, description="weight tensors per layer (w13, w2; 4 with FP8 scales)")
    nominal_expert_bytes: int = Field(
        ge=1, le=2**40, description="bytes of one expert for the time model (DSv3 FP8: 42 MiB)"
    )
    expert_groups: int = Field(
        1,
        ge=1,
        le=65536,
        description="expert groups (vLLM's num_expert_groups; DeepSeek-V3's n_group: 8); "
        "when they split evenly over the nodes the policy is hierarchical",
    )

    def physical_experts(self, ep_size: int) -> int:
        """Physical expert slots of one layer across ``ep_size`` ranks."""
        return self.local_experts * ep_size

    def min_ep_size(self) -> int:
        """The smallest EP size whose slots hold every logical expert."""
        return -(-self.experts // self.local_experts)

    @model_validator(mode="after")
    def _groups_split(self) -> "ModelConfig":
        if self.experts % self.expert_groups:
            raise _Problem("expert_groups", f"{self.expert_groups} does not divide experts = {self.experts}")
        return self


class EplbConfig(_Strict):
    """When EPLB rebalances; vLLM's defaults except ``use_async`` (False here, True in vLLM)."""

    step_interval: int = Field(3000, ge=1, description="forward steps between rebalances")
    window: int = Field(1000, ge=1, description="load window in steps")
    use_async: bool = False
    first_rebalance_step: Union[int, None] = Field(
        None, ge=0, description="step of the first rebalance; default step_interval // 4, as vLLM"
    )

    @model_validator(mode="after")
    def _derive_first(self) -> "EplbConfig":
        if self.first_rebalance_step is None:
            # Written into __dict__ so that it stays out of model_fields_set: with_overrides re-derives it when
            # step_interval changes.
            self.__dict__["first_rebalance_step"] = self.step_interval // 4
        return self


class ServingConfig(_Strict):
    """The serving load: forward steps, routed tokens, and how skewed and how stable expert popularity is."""

    step_time_s: float = Field(0.05, ge=1e-6, le=3600.0, description="simulated seconds per forward step")
    tokens_per_step: int = Field(256, ge=1)
    top_k: int = Field(8, ge=1, description="experts per token")
    skew: float = Field(1.2, ge=0, le=100.0, description="Zipf exponent of expert popularity")
    drift_every_steps: int = Field(0, ge=0, description="re-draw popularity every N steps; 0: never")
    async_scheduling: bool = Field(
        True,
        description="vLLM's --async-scheduling (on by default in 0.33.0): the host does not wait for a step's "
        "sampled tokens before it runs EPLB, so that step's forward work is still queued on the GPU",
    )
    host_ahead_steps: Union[float, None] = Field(
        None,
        ge=0,
        le=100.0,
        description="forward work still queued on a GPU's stream when the host runs EPLB after a forward step, in "
        "steps; default one step with async_scheduling (the host returns from launching the step and "
        "its sampling without waiting), none without it (the bookkeeping's .tolist() waits for the "
        "sampler); applies where the world's memory is device memory (the cuda and rocm-strict profiles)",
    )

    @model_validator(mode="after")
    def _derive_ahead(self) -> "ServingConfig":
        if self.host_ahead_steps is None:
            # In __dict__, out of model_fields_set: with_overrides re-derives it when async_scheduling changes.
            self.__dict__["host_ahead_steps"] = 1.0 if self.async_scheduling else 0.0
        return self


EventKind = Literal["scale_up", "scale_down", "abort", "fail_rank"]
# The vLLM revision whose worker lifecycle the engine follows (docs/simulation.md, "The lifecycle, as vLLM runs it").
# 0.33.0: as released.  pr-53947: the revision with abort_reconfiguration, which epsim first modelled: workers take
# an ABORT, and COMMIT collects once, before the swap.
Lifecycle = Literal["0.33.0", "pr-53947"]


class All2AllConfig(_Strict):
    """The MoE all2all backend of the workers (vLLM's ``--all2all-backend``); ``none`` leaves buffers out."""

    backend: Literal["none", "deepep_high_throughput", "deepep_low_latency"] = "none"
    nvshmem: Literal["stock", "elastic", "mi355"] = Field(
        "stock", description="NVSHMEM as built: stock, vLLM's elastic-EP patch, or MI355's ROCm build"
    )
    explicitly_destroy: bool = Field(True, description="what the managers pass to Buffer (vLLM: True)")


class Event(_Strict):
    """One change to the group.  ``abort``: a reconfiguration to ``to`` ranks is prepared, then aborted."""

    at_step: int = Field(ge=0)
    kind: EventKind
    to: Union[int, None] = Field(None, ge=1, le=MAX_RANKS, description="new EP size (scale_up, scale_down, abort)")
    rank: Union[int, None] = Field(None, ge=0, description="the rank that fails (fail_rank)")
    prepare_s: float = Field(1.0, ge=0, le=86400.0, description="simulated seconds PREPARE takes in the background")

    @model_validator(mode="after")
    def _kind_fields(self) -> "Event":
        if self.kind == "fail_rank":
            if self.rank is None:
                raise _Problem("rank", "fail_rank needs the rank that fails")
            if self.to is not None:
                raise _Problem("to", "fail_rank takes rank, not to (the EP size drops by one)")
        else:
            if self.to is None:
                raise _Problem("to", f"{self.kind} needs the new EP size")
            if self.rank is not None:
                raise _Problem("rank", f"only fail_rank takes a rank, not {self.kind}")
        return self


ParamValue = Union[bool, int, float, str]


class FaultSpec(_Strict):
    """An armed fault site (names are checked by the fault catalogue, not here)."""

    site: str = Field(min_length=1)
    params: dict[str, ParamValue] = Field(default_factory=dict)
    at_step: Union[int, None] = Field(None, ge=0, description="armed from this step; None: from the start")
    times: Union[int, None] = Field(None, ge=1, description="fires at most this often; None: every match")

    @field_validator("params", mode="before")
    @classmethod
    def _param_types(cls, value: Any) -> Any:
        # Checked here so that an error names the parameter, not one member of the union per line.
        if isinstance(value, dict):
            for key, v in value.items():
                if not isinstance(v, (bool, int, float, str)):
                    raise _Problem(
                        str(key), f"a fault parameter is a boolean, integer, number or string, not {type(v).__name__}"
                    )
        return value


class Scenario(_Strict):
    """One run: deployment, load, EPLB, the timeline of group changes, armed faults, strategy and profile."""

    name: str = Field(min_length=1)
    description: str = ""
    ranks: int = Field(ge=1, le=MAX_RANKS, description="initial EP size")
    max_ranks: Union[int, None] = Field(None, ge=1, le=MAX_RANKS, description="the EP size never exceeds this")
    gpus_per_node: int = Field(
        8, ge=1, le=MAX_RANKS, description="ranks per node, filled in rank order; EPLB's policy counts nodes"
    )
    model: ModelConfig
    eplb: EplbConfig = Field(default_factory=EplbConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    all2all: All2AllConfig = Field(default_factory=All2AllConfig)
    timeline: list[Event] = Field(default_factory=list)
    faults: list[FaultSpec] = Field(default_factory=list)
    profile: str = Field("dram", min_length=1)
    strategy: str = Field("shared-agent", min_length=1)
    steps: int = Field(ge=1, le=10**9, description="total forward steps")
    seed: int = Field(0, ge=0, le=2**63 - 1)
    collective_timeout_s: float = Field(300.0, gt=0, le=86400.0)
    lifecycle: Lifecycle = Field(
        "0.33.0",
        description="the vLLM revision whose worker lifecycle is followed: "
        "0.33.0 (as released) or pr-53947 (workers take ABORT)",
    )

    @model_validator(mode="after")
    def _cross_fields(self) -> "Scenario":
        m = self.model
        if self.serving.top_k > m.experts:
            raise _Problem("serving.top_k", f"{self.serving.top_k} exceeds model.experts = {m.experts}")
        if self.max_ranks is not None and self.max_ranks < self.ranks:
            raise _Problem("max_ranks", f"{self.max_ranks} is below ranks = {self.ranks}")
        elements = self.peak_ranks() * m.layers * m.tensors_per_layer * (m.local_experts + 1) * m.hidden
        if elements > MAX_ELEMENTS:
            raise _Problem(
                "model",
                f"peak ranks {self.peak_ranks()} x layers {m.layers} x tensors_per_layer "
                f"{m.tensors_per_layer} x (local_experts {m.local_experts} + 1 buffer row) x "
                f"hidden {m.hidden} = {elements:,} simulated weight elements, over the "
                f"{MAX_ELEMENTS:,} ({MAX_ELEMENTS * 4 >> 30} GiB) a run holds in memory; "
                f"make hidden or the model smaller (nominal_expert_bytes sets the time model)",
            )
        if m.physical_experts(self.ranks) < m.experts:
            raise _Problem(
                "ranks",
                f"{_ranks(self.ranks)} x {m.local_experts} local_experts = "
                f"{m.physical_experts(self.ranks)} physical slots, fewer than "
                f"model.experts = {m.experts}",
            )
        size = self.ranks
        prev_step = 0
        for i, ev in enumerate(self.timeline):
            at = f"timeline[{i}]"
            if ev.at_step >= self.steps:
                raise _Problem(f"{at}.at_step", f"{ev.at_step} is not before steps = {self.steps}")
            if ev.at_step < prev_step:
                raise _Problem(
                    f"{at}.at_step",
                    f"{ev.at_step} comes before timeline[{i - 1}].at_step = "
                    f"{prev_step}; events must be sorted by at_step",
                )
            prev_step = ev.at_step
            if ev.kind == "fail_rank":
                assert ev.rank is not None
                if ev.rank >= size:
                    raise _Problem(
                        f"{at}.rank",
                        f"fail_rank of rank {ev.rank} but only ranks 0..{size - 1} exist at step {ev.at_step}",
                    )
                if size == 1:
                    raise _Problem(f"{at}.rank", f"fail_rank of the only rank at step {ev.at_step}")
                target, field = size - 1, f"{at}.rank"
                what = f"after rank {ev.rank} fails, {_ranks(target)}"
            else:
                assert ev.to is not None
                target, field = ev.to, f"{at}.to"
                if ev.kind == "scale_up" and target <= size:
                    raise _Problem(
                        field,
                        f"scale_up to {target} ranks but {size} already exist at step "
                        f"{ev.at_step}; scale_up must increase the EP size",
                    )
                if ev.kind == "scale_down" and target >= size:
                    raise _Problem(
                        field,
                        f"scale_down to {target} ranks but only {size} exist at step "
                        f"{ev.at_step}; scale_down must decrease the EP size",
                    )
                if ev.kind == "abort" and target == size:
                    raise _Problem(
                        field,
                        f"abort of a reconfiguration to {target} ranks but {size} already "
                        f"exist at step {ev.at_step}; the prepared size must differ",
                    )
                if self.max_ranks is not None and target > self.max_ranks:
                    raise _Problem(field, f"{ev.kind} to {target} ranks exceeds max_ranks = {self.max_ranks}")
                if ev.kind == "abort" and self.lifecycle == "0.33.0":
                    # 0.33.0 has only the external coordinator's abort, which reaches no worker.
                    raise _Problem(
                        f"{at}.kind", "vLLM 0.33.0's workers take no ABORT; an abort needs lifecycle: pr-53947"
                    )
                what = f"{ev.kind} to {_ranks(target)}"
            if m.physical_experts(target) < m.experts:
                raise _Problem(
                    field,
                    f"{what} x {m.local_experts} local_experts = {m.physical_experts(target)} "
                    f"physical slots, fewer than model.experts = {m.experts}",
                )
            if ev.kind != "abort":
                size = target
        draws = self.steps * self.serving.tokens_per_step * self.serving.top_k * self.peak_ranks()
        if draws >= 2**62:  # one routing draw covers up to every step of every rank: numpy's int64 must hold it
            raise _Problem(
                "serving.tokens_per_step",
                f"{self.serving.tokens_per_step} tokens x top_k "
                f"{self.serving.top_k} x steps {self.steps} x peak ranks "
                f"{self.peak_ranks()} routing draws exceed what one draw holds",
            )
        if self.faults:
            self._check_faults()
        return self

    def _check_faults(self) -> None:
        from . import faults as fault_catalogue  # (here: the catalogue imports the fake NIXL's fault sites)

        armed = []
        for i, f in enumerate(self.faults):
            if f.at_step is not None and f.at_step >= self.steps:
                raise _Problem(f"faults[{i}].at_step", f"{f.at_step} is not before steps = {self.steps}")
            for key in ("at_step", "times"):
                given = getattr(f, key)
                if given is not None and key in f.params and f.params[key] != given:
                    raise _Problem(
                        f"faults[{i}].params.{key}",
                        f"{f.params[key]!r} disagrees with faults[{i}].{key} = {given}; give it once",
                    )
            try:  # the checks --fault gets: the site, its parameters, and whether it could ever fire here
                armed += fault_catalogue.arm([f])
                fault_catalogue.check_fits(armed[-1:], self, option="fault")
            except ScenarioError as exc:
                raise _Problem(f"faults[{i}]", str(exc)) from None
        try:
            fault_catalogue.refuse_twice(armed)
        except ScenarioError as exc:
            raise _Problem("faults", str(exc)) from None

    # -- derived views -----------------------------------------------------------------------------------------

    def ep_schedule(self) -> list[tuple[int, int]]:
        """``(step, ep_size)`` from step 0 and at every event that changes the size (aborts do not)."""
        out = [(0, self.ranks)]
        size = self.ranks
        for ev in self.timeline:
            if ev.kind == "abort":
                continue
            size = size - 1 if ev.kind == "fail_rank" else typing.cast(int, ev.to)
            out.append((ev.at_step, size))
        return out

    def ep_sizes(self) -> list[int]:
        """The EP sizes over time, the initial one first: ``[2, 4, 2, 4]`` for elastic-cycle."""
        return [size for _, size in self.ep_schedule()]

    def processes(self) -> int:
        """Rank processes the run starts, first to last: every scale_up (and abort) to a larger size starts new ones
        with new ids, never reusing a departed rank's (fault ``rank=`` parameters name these ids)."""
        started = size = self.ranks
        for ev in self.timeline:
            if ev.kind == "fail_rank":
                size -= 1
                continue
            to = typing.cast(int, ev.to)
            if to > size:
                started += to - size
            if ev.kind != "abort":
                size = to
        return started

    def peak_ranks(self) -> int:
        """The most ranks alive at once, counting those an aborted reconfiguration prepares."""
        prepared = [typing.cast(int, ev.to) for ev in self.timeline if ev.kind == "abort"]
        return max(self.ep_sizes() + prepared)

    # -- writing -----------------------------------------------------------------------------------------------

    def to_yaml(self) -> str:
        """The scenario as YAML, every field written (defaults included); ``load`` of it gives an equal one."""
        return to_yaml(self)

    def dump(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`to_yaml` to ``path`` (a result bundle's ``scenario.yaml``) and return the path."""
        return dump(self, path)


# --------------------------------------------------------------------------------------------------------------
# Errors as one line


def _loc_str(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _join(prefix: str, path: str) -> str:
    if not prefix:
        return path
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class whose field ``loc[-1]`` is, following ``loc`` from :class:`Scenario`."""
    current: Any = Scenario
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return None
        ann = current.model_fields[part].annotation
        while typing.get_origin(ann) in (list, Union):
            ann = next((a for a in typing.get_args(ann) if a is not type(None)), None)
        current = ann
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _close_field(loc: tuple) -> str | None:
    """The field of the model at ``loc`` that an unknown key there most likely meant, if one is close."""
    owner = _model_at(loc)
    if owner is None or not loc:
        return None
    close = difflib.get_close_matches(str(loc[-1]), list(owner.model_fields), n=1)
    return close[0] if close else None


def _error_line(exc: ValidationError) -> str:
    """``field.path: message`` for the first error, with a count of any others."""
    errors = exc.errors()
    # A misspelt key gives two errors, the unknown key and the field it left missing; the unknown key, with its
    # "did you mean", is the one to show first, wherever pydantic listed it.
    err = next(
        (e for e in errors if e["type"] == "extra_forbidden" and _close_field(tuple(e.get("loc", ())))), errors[0]
    )
    loc = tuple(err.get("loc", ()))
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, _Problem):
        line = f"{_join(_loc_str(loc), cause.path)}: {cause.message}"
    elif err["type"] == "extra_forbidden":
        owner = _model_at(loc)
        msg = "unknown key"
        if owner is not None:
            close = _close_field(loc)
            msg += f"; did you mean '{close}'?" if close else f" (allowed: {', '.join(owner.model_fields)})"
        line = f"{_loc_str(loc)}: {msg}"
    else:
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        line = f"{_loc_str(loc) or '(top level)'}: {msg}"
    if len(errors) > 1:
        line += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return _one_line(line)


# --------------------------------------------------------------------------------------------------------------
# Loading


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one)."""


def _mapping_no_duplicates(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # keys a ``<<: *anchor`` merge brings in may be overridden
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, typing.Hashable):  # an unhashable key is refused by construct_mapping below
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_no_duplicates)
# YAML 1.1 (PyYAML) reads 5e-2 and 1e6 as strings: its floats need a dot.  They are numbers here, as in YAML 1.2 and
# in --fault parameters.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+[eE][-+]?[0-9]+$"), list("-+0123456789")
)


class TooDeep(yaml.YAMLError):
    """YAML nested past what the parser's recursion allows: one line, not a RecursionError's thousand."""

    problem = "nested too deeply"

    def __str__(self) -> str:
        return self.problem


def load_value(text: str) -> Any:
    """One YAML value as a scenario file reads it (a whole file, or a ``--set`` value)."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise TooDeep() from None


def from_dict(data: Any, source: str = "scenario") -> Scenario:
    """Validate a mapping (parsed YAML, a dict from code) into a :class:`Scenario`; problems name ``source``."""
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise ScenarioError(f"{source}: the top level must be a mapping of scenario fields, not {kind}")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(f"{source}: {_error_line(exc)}") from None
    except RecursionError:
        raise ScenarioError(f"{source}: a value nested too deeply") from None


MAX_FILE_BYTES = 1 << 20  # a scenario is a few hundred bytes; the largest timelines a few hundred lines


def _load_file(path: Path, shown: str) -> Scenario:
    try:
        if path.exists() and not path.is_dir():
            if not path.is_file():
                raise ScenarioError(f"{shown}: not a regular file (a device or a pipe); give a scenario file")
            if path.stat().st_size > MAX_FILE_BYTES:
                raise ScenarioError(
                    f"{shown}: {path.stat().st_size:,} bytes; a scenario file is at most {MAX_FILE_BYTES:,}"
                )
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError(f"{shown}: no such scenario file") from None
    except IsADirectoryError:
        raise ScenarioError(f"{shown}: is a directory, not a scenario file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{shown}: cannot read: {_one_line(str(exc))}") from None
    try:
        data = load_value(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{shown}:{mark.line + 1}:{mark.column + 1}" if mark is not None else shown
        raise ScenarioError(
            _one_line(f"{where}: invalid YAML: {exc.problem or exc.context or 'syntax error'}")
        ) from None
    except yaml.YAMLError as exc:
        raise ScenarioError(_one_line(f"{shown}: invalid YAML: {exc}")) from None
    return from_dict(data, shown)


def load(path_or_name: str | os.PathLike[str]) -> Scenario:
    """A built-in scenario by name (``scale-up``), or a YAML file by path (``runs/x.yaml``).

    A string with a path separator or a ``.yaml``/``.yml`` suffix is a path; otherwise a built-in name, falling
    back to a file of that name.  Anything wrong is one :class:`ScenarioError` line.
    """
    given = os.fspath(path_or_name)
    names = builtin_names()
    looks_like_path = not isinstance(path_or_name, str) or os.sep in given or "/" in given or given.endswith(_SUFFIXES)
    if not looks_like_path:
        if given in names:
            path = builtin_dir() / f"{given}.yaml"
            return _load_file(path, f"scenarios/{given}.yaml" if path.parent == _REPO_SCENARIOS else str(path))
        if Path(given).is_file():
            return _load_file(Path(given), given)
        listing = ", ".join(names) if names else f"none found in {builtin_dir()} (set EPSIM_SCENARIO_DIR)"
        close = difflib.get_close_matches(given, names, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ScenarioError(
            f"unknown scenario '{given}': {hint}built-ins are {listing}; or give a path to a .yaml file"
        )
    return _load_file(Path(given), given)


# --------------------------------------------------------------------------------------------------------------
# Changing and writing


def _data(scenario: Scenario) -> dict[str, Any]:
    """The scenario as plain data, leaving out values derived from others (so they are derived again)."""
    data = scenario.model_dump(mode="python")
    if "first_rebalance_step" not in scenario.eplb.model_fields_set:
        del data["eplb"]["first_rebalance_step"]
    if "host_ahead_steps" not in scenario.serving.model_fields_set:
        del data["serving"]["host_ahead_steps"]
    return data


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="python")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _merge(node: dict[str, Any], key_path: list[str], value: Any, shown: str) -> None:
    """Set ``key_path`` in ``node`` to ``value``; a mapping merges into a mapping (a list's entries included),
    anything else replaces.  A key that is a number indexes a list (``timeline.0.to``)."""
    for i, key in enumerate(key_path[:-1]):
        node = _child(node, key, key_path[: i + 1], shown)
    last, value = key_path[-1], _plain(value)
    if isinstance(node, list):
        index = _index(node, last, key_path, shown)
        if isinstance(value, dict) and isinstance(node[index], dict):
            for k, v in value.items():
                _merge(node[index], [k], v, shown)
        else:
            node[index] = value
        return
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        for k, v in value.items():
            _merge(node[last], [k], v, shown)
    else:
        node[last] = value


def _index(node: list, key: str, path: list[str], shown: str) -> int:
    if not key.isdigit() or int(key) >= len(node):
        where = ".".join(path[:-1])
        if not node:
            raise ScenarioError(f"override {shown}: {where} is empty; set it whole ({where}=[...])")
        raise ScenarioError(
            f"override {shown}: {'.'.join(path)}: {where} has {len(node)} entries, index them 0..{len(node) - 1}"
        )
    return int(key)


def _child(node: Any, key: str, path: list[str], shown: str) -> Any:
    if isinstance(node, list):
        child = node[_index(node, key, path, shown)]
    else:
        child = node.setdefault(key, {})
    if not isinstance(child, (dict, list)):
        raise ScenarioError(f"override {shown}: {'.'.join(path)} is not a mapping")
    return child


def with_overrides(scenario: Scenario, **changes: Any) -> Scenario:
    """A copy of ``scenario`` with ``changes`` applied and everything validated again.

    Keys are field names; nested fields take a mapping that is merged (``eplb={"step_interval": 400}``) or a
    path with ``__`` or ``.`` (``eplb__step_interval=400``, ``**{"serving.skew": 0.8}``).  Lists are replaced.
    A derived default (``eplb.first_rebalance_step``) follows the new values unless it was given explicitly.
    """
    data = _data(scenario)
    for key, value in changes.items():
        path = key.replace("__", ".").split(".")
        if not all(path):
            raise ScenarioError(f"override {key!r}: empty field name")
        _merge(data, path, value, key)
    return from_dict(data, f"{scenario.name} (with overrides)")


def to_yaml(scenario: Scenario) -> str:
    """The scenario as YAML in schema order, every field written; :func:`load` of it gives an equal one."""
    return yaml.safe_dump(
        scenario.model_dump(mode="json"), sort_keys=False, default_flow_style=False, allow_unicode=True, width=120
    )


def dump(scenario: Scenario, path: str | os.PathLike[str]) -> Path:
    """Write the scenario's YAML to ``path`` (parents created) and return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_yaml(scenario), encoding="utf-8")
    return out
