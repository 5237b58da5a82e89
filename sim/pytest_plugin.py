"""epsim's pytest plugin (entry point ``pytest11: epsim``): fixtures for testing code against the fakes and the
simulator, tests run on many seeds, and failures that say how to replay them.

- ``fake_nixl``: a fresh fake-NIXL world with the ``nixl._api`` import shims installed;
- ``epsim_run``: runs a scenario in the simulator (``epsim_run("scale-up", strategy=..., faults=[...])``) with the
  test's seed and returns its :class:`sim.run.Result`; ``epsim_cluster`` builds a :class:`sim.cluster.Cluster`
  without running it, for tests that drive or inspect one;
- ``@pytest.mark.epsim(seeds=20)``: the test runs once per seed (``epsim_seed`` is the seed); ``--epsim-seeds N``
  or ``--epsim-seeds A:B`` overrides the seeds of every such test;
- ``fake_deep_ep``: ``fake_deep_ep(n, nvshmem="stock")`` gives ``n`` simulated ranks of one process group, with
  ``import deep_ep`` giving the fake; ``ranks.run(body)`` runs ``body(group)`` on every rank and returns what each
  returned (or raised);
- a failing test that ran a simulation gets the command that replays that run, as a report section and in the
  failure message (which JUnit XML carries).

The plugin imports nothing heavy at load time (no torch, no
NIXL, no simulator): pytest loads it in every session of every project that installed epsim.
"""

from __future__ import annotations

import shlex

import pytest

from .ranks import SimulatedRanks

_RUNS = pytest.StashKey[list]()
DEFAULT_SEEDS = 10


_FAKE_SESSION = pytest.StashKey[object]()


def pytest_addoption(parser) -> None:
    group = parser.getgroup("epsim")
    group.addoption(
        "--epsim-seeds",
        default=None,
        metavar="N|A:B",
        help="seeds for tests marked @pytest.mark.epsim: N seeds from 0, or seeds A to B-1",
    )
    group.addoption(
        "--fake-nixl",
        action="store_true",
        default=False,
        help="the whole session imports epsim's fake NIXL under every NIXL package name (nixl._api, "
        "._bindings, ._utils, .logging): run a test suite written for NIXL, NIXL's own included, "
        "against the fake",
    )
    group.addoption(
        "--fake-nixl-profile",
        default="dram",
        metavar="PROFILE",
        help="the fake's profile under --fake-nixl (dram, cuda, rdma, rocm-strict; default dram)",
    )


def _install_fake_nixl(config) -> None:
    """``--fake-nixl``: before collection imports anything, every NIXL name is the fake, until the session ends."""
    if not config.getoption("--fake-nixl"):
        return
    profile = config.getoption("--fake-nixl-profile")
    from fakes import install
    from fakes.nixl import profiles
    from fakes.nixl._fabric import reset_default_fabric

    if profile not in profiles.PROFILES:
        raise pytest.UsageError(f"--fake-nixl-profile {profile!r}: profiles are {', '.join(profiles.PROFILES)}")
    reset_default_fabric(profile)
    shims = install.installed()
    shims.__enter__()
    config.stash[_FAKE_SESSION] = shims


def pytest_unconfigure(config) -> None:
    shims = config.stash.get(_FAKE_SESSION, None)
    if shims is not None:
        shims.__exit__(None, None, None)


def pytest_report_header(config) -> str | None:
    if not config.getoption("--fake-nixl", False):
        return None
    return f"epsim: NIXL is epsim's fake ({config.getoption('--fake-nixl-profile')} profile)"


def pytest_configure(config) -> None:
    _install_fake_nixl(config)
    config.addinivalue_line(
        "markers", "nixl_profile(name): the fake NIXL profile for the fake_nixl fixture (dram, cuda, rdma, rocm-strict)"
    )
    if config.getoption("--epsim-seeds"):
        _option_seeds(config.getoption("--epsim-seeds"))  # a bad value stops the session before collection
    config.addinivalue_line(
        "markers",
        "epsim(seeds=N): run the test once per seed; the epsim_seed fixture is the seed (--epsim-seeds overrides)",
    )


def _option_seeds(text: str) -> list[int]:
    lo, sep, hi = text.partition(":")
    try:
        seeds = list(range(int(lo), int(hi))) if sep else list(range(int(lo)))
    except ValueError:
        seeds = []
    if not seeds:
        raise pytest.UsageError(f"--epsim-seeds {text!r}: give N or A:B (A < B)")
    return seeds


def _seeds(config, marker) -> list[int]:
    text = config.getoption("--epsim-seeds")
    if text:
        return _option_seeds(text)
    spec = marker.kwargs.get("seeds", DEFAULT_SEEDS)
    return list(spec) if not isinstance(spec, int) else list(range(spec))


def pytest_generate_tests(metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("epsim")
    if marker is None:
        return
    seeds = _seeds(metafunc.config, marker)
    if "epsim_seed" in metafunc.fixturenames:
        metafunc.parametrize("epsim_seed", seeds, ids=[f"seed={s}" for s in seeds])


@pytest.fixture
def epsim_seed(request) -> int:
    """The seed of this test (0 unless the test is marked ``@pytest.mark.epsim``)."""
    return getattr(request, "param", 0)


@pytest.fixture
def fake_nixl(request):
    """A fresh fake-NIXL world with the import shims installed: inside the test, ``import nixl._api`` (and the
    nixl_cu12, nixl_cu13, rixl, nixl_rocm variants) gives the fake, and every agent lives in the yielded
    :class:`fakes.nixl.FakeFabric`.  ``@pytest.mark.nixl_profile("rdma")`` picks the profile."""
    import fakes
    from fakes.nixl import FakeFabric

    marker = request.node.get_closest_marker("nixl_profile")
    fabric = FakeFabric(marker.args[0] if marker else "dram")
    with fakes.installed(fabric):
        yield fabric


@pytest.fixture
def fake_deep_ep(epsim_seed):
    """``fake_deep_ep(n, nvshmem="stock")``: :class:`SimulatedRanks` with ``import deep_ep`` giving the fake."""
    from fakes import deep_ep

    with deep_ep.installed():
        yield lambda n, nvshmem="stock": SimulatedRanks(n, epsim_seed, nvshmem)


def _runs(request) -> list:
    return request.node.stash.setdefault(_RUNS, [])


@pytest.fixture
def epsim_run(request, epsim_seed):
    """``epsim_run(scenario, *, strategy=None, profile=None, faults=(), seed=None)``: one simulated run (the test's
    seed unless ``seed`` is given); returns its Result and remembers how to replay it."""
    from sim import scenario as scenario_mod
    from sim.run import run_scenario

    def run(scenario, *, strategy=None, profile=None, faults=(), seed=None):
        sc = scenario_mod.load(scenario) if isinstance(scenario, str) else scenario
        seed = epsim_seed if seed is None else seed
        result = run_scenario(sc, seed=seed, strategy=strategy, profile=profile, faults=list(faults))
        ref = scenario if isinstance(scenario, str) else f"<{sc.name}: write it with sim.scenario.dump>"
        _runs(request).append(replay_command(ref, result))
        return result

    return run


@pytest.fixture
def epsim_cluster(epsim_seed):
    """``epsim_cluster(scenario, *, strategy=None, profile=None, faults=())``: a simulated cluster, not yet run."""
    from sim import faults as catalogue
    from sim import scenario as scenario_mod
    from sim.cluster import Cluster

    def build(scenario, *, strategy=None, profile=None, faults=()):
        sc = scenario_mod.load(scenario) if isinstance(scenario, str) else scenario
        return Cluster(
            sc,
            seed=epsim_seed,
            strategy=strategy or sc.strategy,
            profile=profile or sc.profile,
            faults=[catalogue.parse(f) for f in faults],
        )

    return build


def replay_command(scenario: str, result) -> str:
    args = [
        "epsim",
        "run",
        scenario,
        "--seed",
        str(result.seed),
        "--strategy",
        result.strategy,
        "--profile",
        result.profile,
    ]
    for f in result.faults_armed:
        args += ["--fault", f]
    return " ".join(shlex.quote(a) for a in args)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    runs = item.stash.get(_RUNS, None)
    if report.when == "call" and report.failed and runs:
        text = f"replay the failing seed's run with: {runs[-1]}"
        if len(runs) > 1:
            text += f" ({len(runs)} runs in this test; the last one is shown)"
        longrepr = report.longrepr
        crash = getattr(longrepr, "reprcrash", None)
        if crash is not None:  # the failure message of JUnit XML
            crash.message = f"{crash.message} [epsim replay: {runs[-1]}]"
        if hasattr(longrepr, "addsection"):  # the terminal report, and the failure text of JUnit XML
            longrepr.addsection("epsim replay", text)
        else:
            report.sections.append(("epsim replay", text))
    return report
