"""Strategies of any shape get the verdict their behaviour earns: a package whose sibling modules import ``nixl._api``
at top level is judged as the same code written as one module, whether or not the real NIXL is installed and
whether or not the package was imported before the run; and a run whose code moved experts around the fakes is
refused (exit 3), never judged ``pass``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from sim.errors import HarnessError
from sim.run import run_scenario
from sim.scenario import load

# The strategy: per-communicator-agent, but its agents come from a NIXL bound at module level.
AGENTS = """\
from nixl._api import nixl_agent, nixl_agent_config


def new_agent(name):
    return nixl_agent(name, nixl_agent_config(capture_telemetry=False))
"""
COMM = """\
import uuid

from sim.eplb.communicators.nixl_read import NixlReadCommunicator
from sim.eplb.communicators.per_agent import PerAgentNixlCommunicator

from {agents} import new_agent


class TopLevelNixl(PerAgentNixlCommunicator):
    def __init__(self, group, expert_weights, expert_buffer):
        NixlReadCommunicator.__init__(self, group, expert_weights, expert_buffer)
        self._registered_descs = None
        self.nixl_wrapper = new_agent(f"eplb-{{self._rank}}-{{uuid.uuid4().hex[:8]}}")
        descs = self.nixl_wrapper.get_reg_descs(self._tensors(), self._mem)
        self.nixl_wrapper.register_memory(descs)
        self._registered_descs = descs


def create(group, expert_weights, expert_buffer, prev_communicator=None):
    return TopLevelNixl(group, expert_weights, expert_buffer)
"""
PACKAGE, SINGLE = "toplevel_nixl_pkg.comm:create", "toplevel_nixl_single:create"
# A scale-down with the old communicator collected late: per-communicator-agent's departed peers stay loaded.
CASES = [("scale-down", ()), ("scale-down", ("gc.late:delay_s=2",))]


@pytest.fixture
def strategies(tmp_path, monkeypatch):
    pkg = tmp_path / "toplevel_nixl_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "agents.py").write_text(AGENTS)
    (pkg / "comm.py").write_text(COMM.format(agents=".agents"))
    single = AGENTS + "\n\n" + COMM.replace("from {agents} import new_agent\n", "").format()
    (tmp_path / "toplevel_nixl_single.py").write_text(single)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def summary(strategy: str, scenario: str, faults) -> tuple:
    r = run_scenario(load(scenario), strategy=strategy, faults=list(faults))
    return r.verdict, r.invariant, r.events, r.metrics["transfers"]


@pytest.mark.parametrize("scenario,faults", CASES)
def test_a_package_importing_nixl_at_top_level_is_judged_as_one_module(strategies, scenario, faults) -> None:
    import importlib

    importlib.import_module("toplevel_nixl_pkg.comm")  # imported before the run, outside the fakes: the real NIXL
    one, package = summary(SINGLE, scenario, faults), summary(PACKAGE, scenario, faults)
    assert package == one
    assert package[3] > 0  # the READs went through the fake
    expected = ("pass", None) if not faults else ("safety", "stale_peer")
    assert package[:2] == expected


def test_without_the_real_nixl_the_package_runs_on_the_fakes(strategies) -> None:
    """A CPU-only CI machine without NIXL: the package still loads and runs (it imports nixl at top level)."""
    script = textwrap.dedent(f"""
        import importlib.abc, json, sys
        sys.path.insert(0, {str(strategies)!r})

        class NoNixl(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13"):
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

        sys.meta_path.insert(0, NoNixl())
        from sim.run import run_scenario
        from sim.scenario import load
        out = []
        for strategy in ({PACKAGE!r}, {SINGLE!r}):
            r = run_scenario(load("scale-down"), strategy=strategy, faults=["gc.late:delay_s=2"])
            out.append([r.verdict, r.invariant, r.trace_hash, r.metrics["transfers"]])
        print(json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    package, single = json.loads(done.stdout.strip().splitlines()[-1])
    assert package == single and package[:2] == ["safety", "stale_peer"] and package[3] > 0


def test_code_that_moves_experts_around_the_fakes_is_refused(tmp_path, monkeypatch) -> None:
    """A strategy that keeps a real NIXL it found before the run moves experts correctly and never calls the fake:
    the run cannot be judged, and says so (exit 3 from the command line) instead of saying ``pass``."""
    from tests.conftest import real_nixl_or_skip

    api, _, _ = real_nixl_or_skip()
    (tmp_path / "bound_real_nixl.py").write_text(
        textwrap.dedent("""
        import sys
        import uuid

        from sim.eplb.communicators.nixl_read import NixlReadCommunicator
        from sim.eplb.communicators.per_agent import PerAgentNixlCommunicator

        REAL = sys.modules["epsim_test_real_nixl_api"]  # bound before the fakes were installed


        class RealAgent(PerAgentNixlCommunicator):
            def __init__(self, group, expert_weights, expert_buffer):
                NixlReadCommunicator.__init__(self, group, expert_weights, expert_buffer)
                self._registered_descs = None
                self.nixl_wrapper = REAL.nixl_agent(f"eplb-{self._rank}-{uuid.uuid4().hex[:8]}",
                                                    REAL.nixl_agent_config(backends=["UCX"]))
                descs = self.nixl_wrapper.get_reg_descs(self._tensors(), self._mem)
                self.nixl_wrapper.register_memory(descs)
                self._registered_descs = descs


        def create(group, expert_weights, expert_buffer, prev_communicator=None):
            return RealAgent(group, expert_weights, expert_buffer)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "epsim_test_real_nixl_api", api)
    with pytest.raises(HarnessError, match="without one transfer through epsim's fake NIXL"):
        run_scenario(load("steady"), strategy="bound_real_nixl:create", faults=[])
