"""The ``epsim`` command.  Each command is a thin call into a module; errors are one line and exit status 2."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import typer

try:  # typer >= 0.25 vendors click; older releases depend on it
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as _click_errors  # type: ignore[no-redef]

from . import __version__, quiet
from .errors import BackendUnavailable, BadOutput, EpsimError, InternalError, ScenarioError, UnknownName, one_line, prog
from .outputs import OutputFailed, bundle_dir, run_dir, writable_dir, writable_file, write_file_replacing

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Elastic-EP communicator lifecycle testbed.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"epsim {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Elastic-EP communicator lifecycle testbed."""


# A week: what a --timeout can mean. Larger values overflow the clocks they reach (a thread wait, a gloo store's
# milliseconds) and would end in a traceback after the run has started, so they are refused before any work.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _quiet_nixl_errors() -> None:
    """The catalogue provokes NIXL's errors on purpose (and a validation's faults do on real ranks): the library's
    own log lines for them would bury the verdicts, so it logs only what is fatal, unless NIXL_LOG_LEVEL says
    otherwise.  Set before the library loads, here and in the rank processes, which inherit it."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "FATAL")


@app.command()
def conform(
    backend: str = typer.Option("fake", help="fake or real"),
    profile: Optional[str] = typer.Option(None, help="judge against this profile (default: the one matched)"),
    memory: str = typer.Option("dram", help="dram, or vram on a GPU host"),
    library: str = typer.Option("nixl", help="nixl, or deep_ep (its catalogue; real: a DeepEP build and a GPU)"),
    deep_ep_module: str = typer.Option("deep_ep", help="with --library deep_ep: the module of your DeepEP build"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Run a behaviour catalogue (NIXL's, or DeepEP's) against a backend; for NIXL, name the profile it matches."""
    from . import conform as _conform

    if library == "deep_ep":
        _conform_deep_ep(backend, deep_ep_module, as_json)
        return
    if library != "nixl":
        raise UnknownName(f"library {library!r} not known; use one of: nixl, deep_ep")
    _quiet_nixl_errors()

    report = _conform.run(backend, profile, memory)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "backend": report["backend"],
                    "memory": report["memory"],
                    "profile": report["profile"],
                    "matched_profile": report["matched_profile"],
                    "cases": [
                        {
                            "name": c["name"],
                            "outcome": c["outcome"],
                            "observed": c["observed"],
                            "expected": c["expected"],
                        }
                        for c in report["cases"]
                    ],
                    "notes": report["notes"],
                }
            )
        )
    else:
        for note in report["notes"]:
            typer.echo(f"epsim: note: {note}", err=True)
        for c in report["cases"]:
            line = f"{c['outcome']:4}  {c['name']}"
            if c["outcome"] == "fail":
                line += f"  observed={c['observed']!r} expected={c['expected']!r}"
            elif c["outcome"] == "skip":
                line += f"  ({c.get('reason', '')})"
            typer.echo(line)
        counts = {k: sum(c["outcome"] == k for c in report["cases"]) for k in ("pass", "fail", "skip")}
        typer.echo(
            f"{backend} NIXL on {report['memory']}: {counts['pass']} pass, {counts['fail']} fail, "
            f"{counts['skip']} skip; matched profile: {report['matched_profile'] or 'none'}"
        )
    if report["matched_profile"] is None or any(c["outcome"] == "fail" for c in report["cases"]):
        raise typer.Exit(1)


def _conform_deep_ep(backend: str, module: str, as_json: bool) -> None:
    """The DeepEP catalogue: every case on the fake (simulated ranks) or on a real build (one process per rank)."""
    from real_backends import deep_ep_probe

    if backend not in ("fake", "real"):
        raise UnknownName(f"backend {backend!r} not known; use one of: fake, real")
    if backend == "real" and (why := deep_ep_probe.unavailable(module)):
        raise BackendUnavailable(why)

    def heard(c: dict) -> None:  # each case as it ends, on stderr: a real case takes seconds, a wedged one minutes
        typer.echo(f"epsim: conform: {c['outcome']} {c['name']}", err=True)

    report = deep_ep_probe.run(backend, module, on_case=heard if as_json else None)
    counts = {k: sum(c["outcome"] == k for c in report["cases"]) for k in ("pass", "fail")}
    if as_json:
        typer.echo(json.dumps(report))
    else:
        for c in report["cases"]:
            line = f"{c['outcome']:4}  {c['name']}"
            if c["outcome"] == "fail":
                line += f"  observed={c['observed']!r} expected={c['expected']!r}"
            typer.echo(line)
        typer.echo(
            f"{backend} DeepEP ({report['module']}): {counts['pass']} pass, {counts['fail']} fail "
            f"in {report['seconds']} s"
        )
    if counts["fail"]:
        raise typer.Exit(1)


@app.command()
def run(
    scenario: str = typer.Argument(..., help="a built-in scenario name or a YAML path"),
    seed: Optional[int] = typer.Option(None, min=0, max=2**63 - 1, help="root seed (default: the scenario's)"),
    strategy: Optional[str] = typer.Option(None, help="built-in strategy name or package.module:factory"),
    profile: Optional[str] = typer.Option(None, help="fake NIXL profile: dram, cuda, rdma, rocm-strict"),
    fault: list[str] = typer.Option([], "--fault", help="SITE[:k=v,...], repeatable; see `epsim faults`"),
    out: Optional[str] = typer.Option(None, help="write history.jsonl and trace.perfetto.json here"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    check_determinism: bool = typer.Option(
        False, "--check-determinism", help="run again in a fresh process (other PYTHONHASHSEED); compare"
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="KEY=VALUE scenario override, repeatable (ranks=3, timeline.0.to=2)"
    ),
    backend: str = typer.Option("sim", help="sim (fakes, simulated time) or real (one process per rank, real NIXL)"),
    device: str = typer.Option("cpu", help="real backend: expert weights in host memory (cpu) or VRAM (cuda)"),
    timeout: Optional[float] = typer.Option(
        None,
        min=0.001,
        max=MAX_TIMEOUT_S,
        help="real backend: seconds a rank may take to answer one command "
        "(default 120; a new rank's start-up has 120 s more)",
    ),
    calibration: Optional[str] = typer.Option(
        None, help="simulation: a host's costs, from `epsim calibrate --out FILE` or shipped (cpu-2core-1ms-poll)"
    ),
    ranks_per_host: Optional[int] = typer.Option(
        None, "--ranks-per-host", min=1, help="real backend: most rank processes one host runs at once"
    ),
) -> None:
    """Run SCENARIO and judge it: exit 0 on pass, 1 on any other verdict, 2 on bad input."""
    from . import cli_run

    if backend == "real":
        import os

        from real_backends.launch import serve_slot, under_torchrun

        if under_torchrun() and os.environ["RANK"] != "0":  # a torchrun slot: wait for a rank to run, then exit
            raise typer.Exit(serve_slot())

    if out is not None:
        if (Path(out) / "failure.json").is_file():
            raise BadOutput(
                f"--out {out}: that is a failure bundle, whose history and tape the run would replace; "
                f"give another directory"
            )
        run_dir(out, "--out")  # before the run: a bad path costs one line, not the run
    # With --json, stdout holds the one JSON object: what the code under test prints (a strategy's module at
    # import, a finalizer) goes to stderr.
    quiet = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    try:
        with quiet:
            result, again = cli_run.run_command(
                scenario,
                seed=seed,
                strategy=strategy,
                profile=profile,
                faults=fault,
                out=out,
                check_determinism=check_determinism,
                overrides=overrides,
                backend=backend,
                device=device,
                timeout_s=timeout,
                calibration=calibration,
                ranks_per_host=ranks_per_host,
            )
    except OutputFailed as exc:  # the run finished: its result first, then the one line about its files
        typer.echo(json.dumps(exc.result.to_dict()) if as_json else cli_run.summary(exc.result, None))
        raise OutputFailed(f"{exc}; the run's result is printed above", exc.result) from None
    payload = result.to_dict()
    if again is not None:
        payload["determinism"] = {"trace_hash_again": again, "same": again == result.trace_hash}
    if as_json:
        typer.echo(json.dumps(payload))
    else:
        typer.echo(cli_run.summary(result, again))
    if backend == "sim":
        _FAST_EXIT[0] = True
    if result.verdict != "pass" or (again is not None and again != result.trace_hash):
        raise typer.Exit(1)


@app.command()
def validate(
    device: str = typer.Option("cpu", help="cpu (host memory) or cuda (VRAM, one process per GPU)"),
    quick: bool = typer.Option(False, "--quick", help="a smaller scenario set (the one CI runs)"),
    catalogue: bool = typer.Option(True, "--catalogue/--no-catalogue", help="run the NIXL behaviour catalogue"),
    timeout: float = typer.Option(
        120.0, min=0.001, max=MAX_TIMEOUT_S, help="seconds a rank may take to answer one command"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    calibration: Optional[str] = typer.Option(
        None,
        help="what the cases whose verdict turns on timing simulate with (default: the shipped cpu-2core-1ms-poll)",
    ),
) -> None:
    """Check the simulation's predictions on the real backend: exit 0 when every case agrees, 1 otherwise."""
    from real_backends.nixl_real import require_real
    from real_backends.validate import run_validation

    from .calibration import load as load_calibration

    require_real(device)
    if calibration is not None:
        load_calibration(calibration)  # a bad file is one line now, not after the catalogue
    _quiet_nixl_errors()

    def progress(name: str, row) -> None:
        # Each case's outcome as soon as it is known: an interrupted validation keeps what it found on stderr.
        if row is None:
            typer.echo(f"... {name}", err=True)
        elif "cases" in row:  # the catalogue
            fails = [c["name"] for c in row["cases"] if c["outcome"] == "fail"]
            typer.echo(
                f"    {len(row['cases']) - len(fails)} of {len(row['cases'])} as profile {row['profile']} "
                f"predicts" + (f"; differ: {', '.join(fails)}" if fails else ""),
                err=True,
            )
        else:
            sim, real = row["sim"], row["real"]
            typer.echo(
                f"    {'agrees' if row['agree'] else 'DIFFERS'}: simulated {sim['verdict']}"
                f"{'/' + sim['invariant'] if sim['invariant'] else ''}, real {real['verdict']}"
                f"{'/' + real['invariant'] if real['invariant'] else ''}"
                + ("" if row["agree"] else f" ({'; '.join(row['differences'])})"),
                err=True,
            )

    report = run_validation(device, quick, timeout, catalogue, on_case=progress, calibration=calibration)
    if as_json:
        typer.echo(json.dumps(report))
    else:
        _validation_table(report)
    if not report["agree"]:
        raise typer.Exit(1)


def _validation_table(report) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(140, Console().width))
    conf = report.get("conformance")
    if conf is not None:
        fails = [c["name"] for c in conf["cases"] if c["outcome"] == "fail"]
        console.print(
            f"NIXL catalogue on real {conf['memory'].upper()}: {len(conf['cases']) - len(fails)} of "
            f"{len(conf['cases'])} cases as profile {conf['profile']} predicts; matched profile "
            f"{conf['matched_profile'] or 'none'}" + (f"; differ: {', '.join(fails)}" if fails else "")
        )
        for note in conf.get("notes", ()):  # a note quotes a library's stderr: "[host:pid]" is not rich markup
            console.print(f"note: {escape(note)}")
    table = Table(title=f"simulation ({report['profile']}) vs real ({report['device']})")
    for col in ("case", "simulated", "real", "agree"):
        table.add_column(col, overflow="fold")
    races = 0
    for c in report["cases"]:
        sim, real = c["sim"], c["real"]
        verdict = "yes" if c["agree"] else "NO: " + "; ".join(c["differences"])
        lagged = c.get("with_stream_lag")
        if lagged is not None:
            races += lagged["matches_real"]
            verdict += (
                f" (with {lagged['fault']} the simulation gives "
                f"{_outcome(lagged['sim'])}: "
                + ("the copy/READ race" if lagged["matches_real"] else "not the race")
                + ")"
            )
        table.add_row(c["case"], _outcome(sim), _outcome(real), verdict)
    console.print(table)
    agree = sum(c["agree"] for c in report["cases"])
    race = f"; the copy/READ race without injected lag explains {races} more" if races else ""
    console.print(
        f"{agree} of {len(report['cases'])} scenario cases agree{race} ({report['wall_s']} s); "
        "disagreements are explained in docs/validation.md"
    )
    for row in report.get("skipped", ()):
        console.print(f"skipped: {row['case']} ({escape(row['reason'])})")


def _outcome(r) -> str:
    if r["verdict"] == "pass":
        return "pass"
    what = r["signature"].split("|")[0] if r["verdict"] == "crash" else r["invariant"]
    return f"{r['verdict']}: {what}"


@app.command()
def calibrate(
    device: str = typer.Option("cpu", help="cpu (host memory) or cuda (VRAM; two GPUs when there are two)"),
    out: Optional[str] = typer.Option(None, help="write the calibration JSON here (for `epsim run --calibration`)"),
    compare: bool = typer.Option(
        True, "--compare/--no-compare", help="also time a scale-up in both worlds and report the simulation's error"
    ),
    quick: bool = typer.Option(
        False,
        "--quick",
        help="three sizes and a few repeats: checks that the path works "
        "in about half the time; too few samples to trust",
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Measure the real backend's READ and collective timing; report how far the simulation's times are off."""

    from real_backends import calibrate as cal
    from real_backends.nixl_real import require_real

    require_real(device)
    if out is not None:
        _replaceable_calibration(out)

    def progress(step: str) -> None:  # on stderr: stdout holds the result (one JSON object with --json)
        typer.echo(f"epsim: calibrate: {step} ...", err=True)

    calibration = cal.measure(device, quick=quick, progress=progress)
    unwritten = None
    if out is not None:
        try:
            write_file_replacing(out, calibration.model_dump_json(indent=2) + "\n")
        except OSError as exc:  # a full disk: the measurement is printed below all the same
            unwritten = f"--out {out}: could not write the calibration ({exc.strerror or exc}); it is printed above"
    report = {"calibration": calibration.model_dump()}
    if compare:
        report["comparison"] = cal.compare(
            calibration, device, cases=cal.QUICK_COMPARISONS if quick else cal.COMPARISONS, progress=progress
        )
    if as_json:
        typer.echo(json.dumps(report))
    else:
        _print_calibration(calibration, report.get("comparison"), None if unwritten else out)
    if unwritten:
        raise BadOutput(unwritten)


def _print_calibration(calibration, cmp: Optional[dict], written: Optional[str]) -> None:
    """`epsim calibrate`'s readable output: the measurement, the file it went to, and the comparison if one ran."""
    c = calibration
    typer.echo(
        f"READ on {c.memory}: {c.xfer_latency_s * 1e6:.1f} us + bytes / {c.bandwidth_Bps / 1e9:.2f} GB/s, "
        f"first READ to a peer +{c.connect_s * 1e3:.2f} ms; gloo all_reduce {c.collective_latency_s * 1e6:.0f} "
        f"us; rank process start {c.process_start_s:.2f} s (two processes)"
    )
    for row in c.loaded:
        typer.echo(
            f"{row.ranks} rank processes: READ {row.xfer_latency_s * 1e3:.2f} ms + {row.post_s * 1e3:.2f} ms "
            f"each + bytes / {row.bandwidth_Bps / 1e9:.2f} GB/s; all_reduce {row.collective_s * 1e3:.2f} ms "
            f"(+{row.stall_s * 1e3:.2f} ms in a rebalance, fitted); "
            f"gc.collect {row.collect_s * 1e3:.0f} ms; agent {row.first_agent_s * 1e3:.0f} ms (first), "
            f"{row.agent_s * 1e3:.0f} ms; add_remote_agent {row.first_remote_setup_s * 1e3:.1f} ms (first), "
            f"{row.remote_setup_s * 1e3:.1f} ms"
        )
    if c.quick:
        typer.echo("measured with --quick: too few samples to trust these numbers")
    if c.concurrent_share is not None:
        typer.echo(
            f"4 READs posted together took {c.concurrent_share:.2f}x as long as 4 single READs (1: they "
            f"share the process's bandwidth, as the simulation models them; 0.25: each had all of it)"
        )
    if written is not None:
        typer.echo(f"written to {written}; use it with `epsim run SCENARIO --calibration {written}`")
    if cmp is None:
        return
    for run in cmp["runs"]:
        role = "fitted on" if run["fitted"] else "judged"
        typer.echo(
            f"{run['scenario']} ({role}): simulated vs measured (error = simulated / measured - 1); "
            f"verdicts: simulated {run['sim_verdict']}, real {run['real_verdict']}"
        )
        for r in run["spans"]:
            error = "n/a" if r["error"] is None else f"{r['error']:+.1%}"
            typer.echo(f"  {r['what']:20} {r['simulated_s']:9.4f} s  {r['measured_s']:9.4f} s  {error}")
        if not run["complete"]:
            typer.echo(
                f"  INCOMPLETE: {len(run['spans'])} of {run['spans_simulated']} simulated and "
                f"{run['spans_measured']} measured spans compared"
                + (f"; the real run: {run['real_detail']}" if run["real_detail"] else "")
            )
    typer.echo("median error of each kind over the judged runs (the fitted run's in brackets):")
    for kind, row in cmp["summary"].items():
        mark = "" if row["within_25%"] else "  (outside 25%)"
        fitted = cmp["fitted_summary"].get(kind)
        also = f"  [{fitted['median_error']:+.1%}]" if fitted else ""
        typer.echo(f"  {kind:20} {row['median_error']:+.1%} over {row['count']}{also}{mark}")


def _replaceable_calibration(out: str) -> None:
    """``--out`` of ``epsim calibrate``: a new file, or an earlier calibration to replace; never another file,
    which a measurement minutes long would otherwise overwrite without a word."""
    from .calibration import load

    p = writable_file(out, "--out")
    if p.exists() or p.is_symlink():
        try:
            load(p)
        except ScenarioError:
            raise BadOutput(
                f"--out {out}: that file exists and is not an epsim calibration; give a new file name, "
                f"or an earlier calibration to replace"
            ) from None


@app.command()
def scenarios(as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """List the built-in scenarios."""
    from . import scenario as sc

    if not sc.builtin_dir().is_dir():
        raise ScenarioError(
            f"no scenario folder at {sc.builtin_dir()} (EPSIM_SCENARIO_DIR names a folder of .yaml files)"
        )
    rows: list[dict[str, Any]] = []
    broken: list[str] = []
    for name in sc.builtin_names():
        try:
            s = sc.load(name)
        except ScenarioError as exc:  # the others are still worth listing; this one is named below
            broken.append(str(exc))
            continue
        rows.append(
            {
                "name": name,
                "ranks": s.ep_sizes(),
                "steps": s.steps,
                "layers": s.model.layers,
                "experts": s.model.experts,
                "description": " ".join(s.description.split()),
            }
        )
    if as_json:
        typer.echo(json.dumps(rows))
    else:
        import shutil
        import textwrap

        width = shutil.get_terminal_size((120, 24)).columns
        for r in rows:
            sizes = "->".join(str(x) for x in r["ranks"])
            head = (
                f"{r['name']:18} EP {sizes:18} {r['layers']:3} layers {r['experts']:4} experts {r['steps']:6} steps  "
            )
            # Cut at a word, and say so: the whole text is in `epsim scenarios --json` and the scenario's file.
            typer.echo(head + textwrap.shorten(r["description"], max(20, width - len(head)), placeholder=" ..."))
    for line in broken:
        print(f"epsim: error: {line}", file=sys.stderr)
    if broken:
        raise typer.Exit(2)


@app.command()
def faults(as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """List every fault site with its parameters."""
    from . import faults as catalogue

    rows = [
        {"site": site, "description": desc, "params": sorted(catalogue.params_of(site))}
        for site, desc in catalogue.SITES.items()
    ]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for r in rows:
        typer.echo(f"{r['site']:22} {r['description']}  [{', '.join(r['params'])}]")
    typer.echo(
        "\nEvery site takes rank=N (only rank process N: calls by its agents for nixl.*, what it drops for "
        "gc.*, that rank for the others), times=K (at most K firings) and at_step=S (from forward step S). "
        f"The gc.* sites also take what=TEXT: only drops whose name contains it ({', '.join(catalogue.DROPS)})."
    )


@app.command()
def sweep(
    scenario: str = typer.Argument(..., help="a built-in scenario name or a YAML path"),
    seeds: str = typer.Option(..., help="A:B runs seeds A to B-1 (or one seed N)"),
    strategy: list[str] = typer.Option([], "--strategy", help="repeatable; default: the scenario's"),
    profile: list[str] = typer.Option([], "--profile", help="repeatable; default: the scenario's"),
    fault: list[str] = typer.Option([], "--fault", help="SITE[:k=v,...], armed in every run; repeatable"),
    swarm: bool = typer.Option(False, "--swarm", help="each seed also arms its own random subset of fault sites"),
    engine: str = typer.Option("local", help="local (worker processes) or ray"),
    workers: Optional[int] = typer.Option(None, min=1, help="parallel runs (default: CPU count)"),
    ray_address: Optional[str] = typer.Option(None, help="Ray cluster to join (default: start a local one)"),
    db: str = typer.Option("epsim-results.db", help="SQLite results database"),
    bundles: Optional[str] = typer.Option(None, help="folder for failure bundles (default: next to --db)"),
    resume: bool = typer.Option(False, "--resume", help="skip runs the database already holds"),
    timeout: Optional[float] = typer.Option(
        None, min=0.001, max=MAX_TIMEOUT_S, help="kill a run after this many wall seconds"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object at the end"),
) -> None:
    """Run SCENARIO for every seed x strategy x profile, store each run, bundle each new failure signature."""
    from .lab import executors, resultsdb
    from .lab import sweep as sweep_mod
    from .progress import SweepProgress

    specs = sweep_mod.plan(scenario, sweep_mod.parse_seeds(seeds), strategy, profile, fault, swarm)
    eng = executors.make(engine, workers, timeout, ray_address)
    writable_file(db, "--db")
    bundles_dir = Path(bundles) if bundles else Path(db).with_name(Path(db).stem + "-bundles")
    # Checked before any run, the default next to --db too (made only when a failure needs it): a failure found
    # later must have somewhere to go.
    if bundles is not None:
        writable_dir(bundles, "--bundles")
    else:
        writable_dir(bundles_dir, "the bundles folder next to --db", make=False)
    eng.start()  # a Ray cluster that cannot be joined is refused before the database is made
    command = "epsim sweep " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    stored_before = 0
    terminated = []

    def on_term(signum, frame) -> None:  # a SIGTERM stops the sweep as ^C does, its runs kept, and exits 143
        terminated.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        with resultsdb.ResultsDB(db) as database, SweepProgress(len(specs)) as progress:
            stored_before = database.count()
            try:
                outcome = sweep_mod.run_sweep(
                    specs, database, eng, resume=resume, bundles_dir=bundles_dir, command=command, on_result=progress
                )
            except KeyboardInterrupt:
                kept = database.count() - stored_before
                print(
                    f"epsim: interrupted: {kept} run{'s' if kept != 1 else ''} of this sweep kept in {db}; the "
                    f"same command with --resume runs the rest",
                    file=sys.stderr,
                )
                _interrupt_said.append(True)
                raise typer.Exit(143 if terminated else 130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    payload = {
        "planned": outcome.planned,
        "skipped": outcome.skipped,
        "ran": outcome.ran,
        "verdicts": outcome.verdicts,
        "new_signatures": outcome.new_signatures,
        "bundles": outcome.bundles,
        "wall_s": round(outcome.wall_s, 3),
        "runs_per_s": round(outcome.ran / max(outcome.wall_s, 1e-9), 2),
        "db": db,
        "engine": engine,
    }
    if as_json:
        typer.echo(json.dumps(payload))
        return
    counts = ", ".join(f"{v} {k}" for k, v in sorted(outcome.verdicts.items())) or "nothing to run"
    typer.echo(
        f"{outcome.ran} runs in {outcome.wall_s:.1f} s ({payload['runs_per_s']} runs/s) on {engine}"
        + (f", {outcome.skipped} already stored" if outcome.skipped else "")
        + f": {counts}"
    )
    for sig, path in zip(outcome.new_signatures, outcome.bundles):
        typer.echo(f"new failure {sig}: {prog()} replay {shlex.quote(path)}")
    typer.echo(f"results in {db}; summary: {prog()} report {shlex.quote(db)}")


@app.command()
def replay(
    bundle: str = typer.Argument(..., help="a failure bundle folder (failure.json inside)"),
    out: Optional[str] = typer.Option(None, help="write the replay's history and trace here"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Run a failure bundle again: exit 0 if it gives the same signature and trace hash, 1 if not."""
    from .lab import bundle as bundle_mod

    if out is not None:
        if Path(out).resolve() == Path(bundle).resolve():  # the bundle's own history would give way to the replay's
            raise BadOutput(f"--out {out}: that is the bundle being replayed; give another directory")
        if (Path(out) / "failure.json").is_file():
            raise BadOutput(
                f"--out {out}: that is a failure bundle, whose tape and history the replay would "
                f"replace; give another directory"
            )
        run_dir(out, "--out")
    unwritten: OutputFailed | None = None
    try:
        rep = bundle_mod.replay(bundle, out)
    except OutputFailed as exc:  # the replay finished: its outcome first, then the one line about its files
        rep, unwritten = bundle_mod.Replay(bundle_mod.load(bundle), exc.result), exc
    exp, r = rep.bundle.expected, rep.result
    tape = rep.tape_divergence()
    payload = {
        "bundle": bundle,
        "reproduced": rep.reproduced,
        "signature": r.signature,
        "expected_signature": exp["signature"],
        "trace_hash": r.trace_hash,
        "expected_trace_hash": exp["trace_hash"],
        "verdict": r.verdict,
        "detail": r.detail,
        "tape_divergence": tape,
    }
    if as_json:
        typer.echo(json.dumps(payload))
    else:
        typer.echo(
            f"{'reproduced' if rep.reproduced else 'NOT reproduced'}: {r.signature} "
            f"(expected {exp['signature']}), trace {r.trace_hash} (expected {exp['trace_hash']})"
        )
        if r.detail:
            typer.echo(f"detail: {r.detail}")
        if tape:
            typer.echo(f"tape: {tape}")
    if unwritten is not None:
        raise OutputFailed(f"{unwritten}; the replay's outcome is printed above", unwritten.result)
    if not rep.reproduced:
        raise typer.Exit(1)


@app.command()
def shrink(
    bundle: str = typer.Argument(..., help="a failure bundle folder"),
    out: Optional[str] = typer.Option(None, help="where the shrunk bundle goes (default: BUNDLE-shrunk)"),
    max_runs: int = typer.Option(200, min=1, help="give up after this many candidate runs"),
    corpus: Optional[str] = typer.Option(
        None,
        help="also save the shrunk bundle into this regression corpus "
        "(e.g. tests/corpus, which the test suite replays)",
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Minimise a failure bundle (faults, elastic events, ranks, layers, steps) keeping its failure signature."""
    from .lab import shrink as shrink_mod

    def show(change: str, kept: bool) -> None:
        if not as_json:
            typer.echo(f"  {'removed' if kept else 'kept   '} {change}")

    from .lab import bundle as bundle_mod

    bundle_mod.load(bundle)  # a folder that is not a bundle costs one line here, not after the --out checks
    # Checked, not made: the shrunk bundle's folder appears only when there is a bundle to put in it.
    target = bundle_dir(
        out if out is not None else shrink_mod.default_target(bundle),
        "--out" if out is not None else "the default --out",
        source=bundle,
        make=False,
    )
    if corpus is not None:
        writable_dir(corpus, "--corpus", files=(), make=False)
        src = Path(bundle).resolve()
        if src == Path(corpus).resolve() or src in Path(corpus).resolve().parents:
            raise BadOutput(
                f"--corpus {corpus}: that is inside the bundle being shrunk; give the corpus folder "
                f"that holds bundles (such as {src.parent})"
            )
        # Re-shrinking a corpus bundle into its own corpus replaces it, once the shrink is done: no source check.
        bundle_dir(Path(corpus) / target.name, "--corpus", make=False)
    try:
        res = shrink_mod.shrink(bundle, target, max_runs=max_runs, on_step=show)
    except shrink_mod.NotReproduced as exc:
        typer.echo(f"not shrunk: {exc}", err=True)
        raise typer.Exit(1) from None
    assert res.bundle is not None  # shrink() writes the smallest failing configuration it found
    saved = str(bundle_mod.save_to_corpus(res.bundle, corpus)) if corpus else None
    before, after = res.original.size(), res.final.size()
    names = ("faults", "elastic events", "peak ranks", "layers", "steps")
    payload = {
        "bundle": str(res.bundle),
        "runs": res.runs,
        "removed": res.removed,
        "corpus": saved,
        "before": dict(zip(names, before)),
        "after": dict(zip(names, after)),
        "faults": res.final.faults,
    }
    if as_json:
        typer.echo(json.dumps(payload))
        return
    typer.echo(f"{res.runs} runs; " + ", ".join(f"{n} {a}->{b}" for n, a, b in zip(names, before, after)))
    typer.echo(f"shrunk bundle: {res.bundle} ({prog()} replay {shlex.quote(str(res.bundle))})")
    if saved:
        typer.echo(f"saved to the regression corpus: {saved}")


@app.command()
def report(
    db: str = typer.Argument(..., help="a results database written by epsim sweep"),
    plots: Optional[str] = typer.Option(None, help="folder for the PNG plots (default: DB stem + -report)"),
    no_plots: bool = typer.Option(False, "--no-plots", help="tables only"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Summarise a results database: verdicts, failures by signature, fault coverage, plots."""

    from rich.console import Console

    from .lab import report as report_mod
    from .lab import resultsdb
    from .errors import BackendUnavailable

    with resultsdb.open_existing(db) as database:  # first: a path that is no database is one line
        folder = Path(plots) if plots is not None else Path(db).with_name(Path(db).stem + "-report")
        if not no_plots:  # before the summary's work: a bad folder is one line
            writable_dir(
                plots if plots is not None else folder,
                "--plots" if plots is not None else "the default --plots",
                files=report_mod.PLOTS,
            )
        summary = report_mod.summarise(database)
    written: list[str] = []
    unwritten: BadOutput | None = None
    if not no_plots:
        try:
            written = [str(p) for p in report_mod.plot(summary, folder)]
        except BackendUnavailable as exc:
            if plots:  # asked for by name: an error, not a note
                raise
            print(f"epsim: note: {exc}", file=sys.stderr)
        except BadOutput as exc:  # (a full disk) the summary is done: it is printed, then the error
            unwritten = exc
    if as_json:
        typer.echo(json.dumps({**summary.to_json(), "plots": written}))
    else:
        report_mod.render(summary, Console())
        for p in written:
            typer.echo(f"plot: {p}")
    if unwritten is not None:
        raise unwritten


@app.command()
def bench(
    quick: bool = typer.Option(False, "--quick", help="smaller workloads (about two minutes instead of seven)"),
    only: list[str] = typer.Option([], "--only", help="measure only this figure (repeatable)"),
    device: str = typer.Option("cpu", help="real_transfers on cpu (host memory) or cuda (VRAM, two GPUs if there)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object with a key per figure"),
) -> None:
    """Measure epsim's speed figures, each against a baseline of the same run, and compare them with targets."""
    from rich.console import Console
    from rich.table import Table

    try:
        from benchmarks import suite
    except ImportError:
        raise EpsimError("epsim bench runs from a source checkout (the benchmarks/ folder beside sim/)") from None
    unknown = [o for o in only if o not in suite.TARGETS]
    if unknown:
        raise EpsimError(f"--only {unknown[0]!r}: figures are {', '.join(suite.TARGETS)}")

    def progress(name: str, figure: dict, seconds: float) -> None:
        print(f"bench: {name} measured in {seconds:.0f} s", file=sys.stderr)

    if device not in ("cpu", "cuda"):
        raise EpsimError(f"--device {device!r}: use cpu or cuda")
    if device == "cuda" and (not only or "real_transfers" in only):
        # Up front, in one line: otherwise the figure's peer process dies with torch's traceback on stderr, after
        # every figure before it was measured.
        from real_backends.nixl_real import require_real

        require_real(device)
    results = suite.run(quick, only or None, on_figure=progress, device=device)
    if as_json:
        typer.echo(json.dumps(results))
        return
    table = Table(title="epsim bench" + (" --quick" if quick else ""))
    for col in ("figure", "measured", "target", "met"):
        table.add_column(col, overflow="fold")
    for name in suite.TARGETS:
        if name in results:
            table.add_row(*suite.line(name, results[name]))
    Console(width=max(120, Console().width)).print(table)


# Set by a simulated `epsim run` once its verdict is out: nothing is left but tearing down the simulated world (a
# million history records and every rank's objects at DeepSeek scale, a second or two), which the OS does faster.
_FAST_EXIT = [False]


def _exit(status: int, fast: bool) -> None:
    if fast and _FAST_EXIT[0]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


_interrupt_said: list[bool] = []  # a command that said what an interruption left (a sweep) says it only once


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: click's multi-line usage errors and epsim's own errors both become one line, exit 2."""
    atexit.register(quiet.for_good)
    fast = argv is None  # the program itself, not a caller that goes on running in this process
    if fast and hasattr(faulthandler, "register"):  # `kill -USR1 PID`: every thread's stack on stderr, run goes on
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    try:
        # Without standalone mode click returns a command's exit status instead of exiting.
        status = app(args=argv, standalone_mode=False, prog_name="epsim")
    except typer.Exit as done:
        _exit(done.exit_code, fast)
    except (typer.Abort, KeyboardInterrupt):
        print("epsim: interrupted", file=sys.stderr)
        sys.exit(130)
    except _click_errors.ClickException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            sys.exit(2)  # the help text is already out
        print(f"epsim: error: {exc.format_message()}", file=sys.stderr)
        sys.exit(2)
    except EpsimError as exc:
        print(f"epsim: error: {one_line(str(exc))}", file=sys.stderr)
        sys.exit(2)
    except InternalError as exc:
        print(f"epsim: internal error: {one_line(str(exc))}", file=sys.stderr)
        sys.exit(3)
    if status == 130 and not _interrupt_said:  # typer turns ^C into Exit(130), which click returns here, silently
        print("epsim: interrupted", file=sys.stderr)
    _exit(status if isinstance(status, int) else 0, fast)


if __name__ == "__main__":
    main()
