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
