"""The ``epsim`` command.  Each command is a thin call into a module; errors are one line and exit status 2."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

try:  # typer >= 0.25 vendors click; older releases depend on it
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as _click_errors

from . import __version__
from .errors import EpsimError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Elastic-EP communicator lifecycle testbed.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"epsim {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Elastic-EP communicator lifecycle testbed."""


@app.command()
def conform(
    backend: str = typer.Option("fake", help="fake or real"),
    profile: Optional[str] = typer.Option(None, help="judge against this profile (default: the one matched)"),
    memory: str = typer.Option("dram", help="dram, or vram on a GPU host"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Run the NIXL behaviour catalogue against a backend and name the profile it matches."""
    from . import conform as _conform

    report = _conform.run(backend, profile, memory)
    if as_json:
        typer.echo(json.dumps({"backend": report["backend"], "memory": report["memory"],
                               "profile": report["profile"], "matched_profile": report["matched_profile"],
                               "cases": [{"name": c["name"], "outcome": c["outcome"], "observed": c["observed"],
                                          "expected": c["expected"]} for c in report["cases"]]}))
    else:
        for c in report["cases"]:
            line = f"{c['outcome']:4}  {c['name']}"
            if c["outcome"] == "fail":
                line += f"  observed={c['observed']!r} expected={c['expected']!r}"
            elif c["outcome"] == "skip":
                line += f"  ({c.get('reason', '')})"
            typer.echo(line)
        counts = {k: sum(c["outcome"] == k for c in report["cases"]) for k in ("pass", "fail", "skip")}
        typer.echo(f"{backend} NIXL on {report['memory']}: {counts['pass']} pass, {counts['fail']} fail, "
                   f"{counts['skip']} skip; matched profile: {report['matched_profile'] or 'none'}")
    if report["matched_profile"] is None or any(c["outcome"] == "fail" for c in report["cases"]):
        raise typer.Exit(1)


@app.command()
def run(
    scenario: str = typer.Argument(..., help="a built-in scenario name or a YAML path"),
    seed: Optional[int] = typer.Option(None, help="root seed (default: the scenario's)"),
    strategy: Optional[str] = typer.Option(None, help="built-in strategy name or package.module:factory"),
    profile: Optional[str] = typer.Option(None, help="fake NIXL profile: dram, cuda, rdma, rocm-strict"),
    fault: list[str] = typer.Option([], "--fault", help="SITE[:k=v,...], repeatable; see `epsim faults`"),
    out: Optional[str] = typer.Option(None, help="write history.jsonl and trace.perfetto.json here"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    check_determinism: bool = typer.Option(False, "--check-determinism",
                                           help="run again in a fresh process (other PYTHONHASHSEED); compare"),
) -> None:
    """Simulate SCENARIO and judge it: exit 0 on pass, 1 on any other verdict, 2 on bad input."""
    from . import runner

    result, again = runner.run_command(scenario, seed=seed, strategy=strategy, profile=profile, faults=fault,
                                       out=out, check_determinism=check_determinism)
    payload = result.to_dict()
    if again is not None:
        payload["determinism"] = {"trace_hash_again": again, "same": again == result.trace_hash}
    if as_json:
        typer.echo(json.dumps(payload))
    else:
        typer.echo(runner.summary(result, again))
    if result.verdict != "pass" or (again is not None and again != result.trace_hash):
        raise typer.Exit(1)


@app.command()
def scenarios(as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """List the built-in scenarios."""
    from . import scenario as sc

    rows = []
    for name in sc.builtin_names():
        s = sc.load(name)
        rows.append({"name": name, "ranks": s.ep_sizes(), "steps": s.steps, "layers": s.model.layers,
                     "experts": s.model.experts, "description": " ".join(s.description.split())})
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for r in rows:
        sizes = "->".join(str(x) for x in r["ranks"])
        typer.echo(f"{r['name']:18} EP {sizes:18} {r['layers']:3} layers {r['experts']:4} experts "
                   f"{r['steps']:6} steps  {r['description'][:70]}")


@app.command()
def faults(as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """List every fault site with its parameters."""
    from . import faults as catalogue

    rows = [{"site": site, "description": desc, "params": sorted(catalogue.params_of(site))}
            for site, desc in catalogue.SITES.items()]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for r in rows:
        typer.echo(f"{r['site']:22} {r['description']}  [{', '.join(r['params'])}]")


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: click's multi-line usage errors and epsim's own errors both become one line, exit 2."""
    try:
        # Without standalone mode click returns a command's exit status instead of exiting.
        status = app(args=argv, standalone_mode=False, prog_name="epsim")
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.Abort:
        print("epsim: aborted", file=sys.stderr)
        sys.exit(130)
    except _click_errors.ClickException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            sys.exit(2)  # the help text is already out
        print(f"epsim: error: {exc.format_message()}", file=sys.stderr)
        sys.exit(2)
    except EpsimError as exc:
        print(f"epsim: error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(status if isinstance(status, int) else 0)


if __name__ == "__main__":
    main()
