"""``epsim report``: what a results database says.

- verdicts per strategy x profile;
- failures grouped by signature (invariant, strategy, first implicated fault), with a bundle to replay each;
- fault coverage per site: in how many runs it was armed, fired, and implicated in the failure, and the failure rate
  of the runs that armed it;
- plots (PNG, with matplotlib from the ``plot`` extra): failure rate per fault site, verdicts per strategy.  Each
  PNG carries the numbers it draws in its ``Description`` text chunk, so a reader (or a test) can check them.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailable, BadOutput, prog
from ..outputs import write_replacing


def site(fault: str) -> str:
    return fault.partition(":")[0]


@dataclass
class Summary:
    runs: int = 0
    verdicts: Counter = field(default_factory=Counter)
    by_config: dict[tuple[str, str], Counter] = field(default_factory=lambda: defaultdict(Counter))
    signatures: Counter = field(default_factory=Counter)
    signature_bundle: dict[str, str] = field(default_factory=dict)
    signature_seeds: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    armed: Counter = field(default_factory=Counter)  # site -> runs that armed it
    fired: Counter = field(default_factory=Counter)  # site -> runs in which it fired
    implicated: Counter = field(default_factory=Counter)  # site -> failing runs it fired before the failure of
    failed_when_armed: Counter = field(default_factory=Counter)  # site -> failing runs that armed it

    def failure_rate(self, s: str) -> float:
        return self.failed_when_armed[s] / self.armed[s] if self.armed[s] else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "verdicts": dict(sorted(self.verdicts.items())),
            "signatures": dict(self.signatures.most_common()),
            "bundles": dict(sorted(self.signature_bundle.items())),
            "by_config": [
                {"strategy": st, "profile": pr, "verdicts": dict(sorted(c.items()))}
                for (st, pr), c in sorted(self.by_config.items())
            ],
            "coverage": {
                s: {
                    "armed": self.armed[s],
                    "fired": self.fired[s],
                    "implicated": self.implicated[s],
                    "failure_rate": round(self.failure_rate(s), 4),
                }
                for s in sorted(self.armed)
            },
        }


def summarise(db) -> Summary:
    out = Summary()
    for row in db.rows():
        out.runs += 1
        v = row["verdict"]
        out.verdicts[v] += 1
        out.by_config[(row["strategy"], row["profile"])][v] += 1
        failed = v != "pass"
        if failed and row["signature"]:
            sig = row["signature"]
            out.signatures[sig] += 1
            if len(out.signature_seeds[sig]) < 5:
                out.signature_seeds[sig].append(row["seed"])
            if row["bundle"]:
                out.signature_bundle.setdefault(sig, row["bundle"])
        sites = {site(f) for f in row["faults_armed"]}
        for s in sites:
            out.armed[s] += 1
            out.failed_when_armed[s] += failed
        for s in {site(f) for f, n in row["faults_fired"].items() if n}:
            out.fired[s] += 1
        for s in {site(f) for f in row["implicated"]}:
            out.implicated[s] += 1
    return out


def render(summary: Summary, console) -> None:
    from rich.table import Table

    verdict_names = sorted(summary.verdicts)
    t = Table(title=f"{summary.runs} runs: verdicts per strategy x profile")
    t.add_column("strategy")
    t.add_column("profile")
    for v in verdict_names:
        t.add_column(v, justify="right")
    for (st, pr), c in sorted(summary.by_config.items()):
        t.add_row(st, pr, *[str(c.get(v, 0)) for v in verdict_names])
    console.print(t)

    if summary.signatures:
        t = Table(title="failures by signature (invariant | strategy | first implicated fault)")
        t.add_column("runs", justify="right")
        t.add_column("signature", overflow="fold")
        t.add_column("seeds")
        t.add_column("replay", overflow="fold")
        for sig, n in summary.signatures.most_common():
            bundle = summary.signature_bundle.get(sig)
            seeds = ", ".join(map(str, summary.signature_seeds[sig]))
            if n > len(summary.signature_seeds[sig]):  # the first few, and say so
                seeds += f", ... ({n} runs)"
            t.add_row(str(n), sig, seeds, f"{prog()} replay {bundle}" if bundle else "-")
        console.print(t)
    else:
        console.print("no failures")

    if summary.armed:
        t = Table(title="fault coverage")
        for col in ("site", "armed", "fired", "implicated", "failure rate when armed"):
            t.add_column(col, justify="left" if col == "site" else "right")
        for s in sorted(summary.armed):
            t.add_row(
                s,
                str(summary.armed[s]),
                str(summary.fired[s]),
                str(summary.implicated[s]),
                f"{summary.failure_rate(s):.1%}",
            )
        console.print(t)


PLOTS = ("failure_rate_by_site.png", "verdicts_by_config.png")  # what plot() writes


def _save(plt, fig, path: Path, data: dict) -> None:
    """The figure as ``path`` (its numbers in the PNG's Description), written as :func:`~sim.outputs.write_replacing`
    writes: a full disk leaves an earlier report's plot as it was.  An error is :class:`BadOutput`."""
    try:
        write_replacing(
            path,
            lambda tmp: fig.savefig(
                tmp, dpi=100, format="png", metadata={"Description": json.dumps(data, sort_keys=True)}
            ),
        )
    except OSError as exc:
        raise BadOutput(
            f"{path}: could not write the plot ({exc.strerror or exc}); an earlier one there is kept"
        ) from None
    finally:
        plt.close(fig)


def plot(summary: Summary, folder: str | Path) -> list[Path]:
    """Write the PNGs into ``folder``; returns their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BackendUnavailable("plots need matplotlib: pip install 'epsim[plot]' (or pass --no-plots)") from None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []

    # Two bars a site: of the runs that armed it, those that failed (for any reason: a site armed alongside the
    # one that broke the run fails with it) and those whose failure it fired before; a site that never fired can
    # have the first and not the second, and its label says it never fired.
    sites = sorted(summary.armed)
    rates = [summary.failure_rate(s) for s in sites]
    implicated = [summary.implicated[s] / summary.armed[s] for s in sites]
    labels = [s if summary.fired[s] else f"{s}\n(never fired)" for s in sites]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(sites) + 2), 4))
    x = range(len(sites))
    ax.bar([i - 0.2 for i in x], rates, width=0.4, color="#e8a09a", label="failed, when armed")
    ax.bar([i + 0.2 for i in x], implicated, width=0.4, color="#c0392b", label="failed after it fired")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("share of the runs that armed the site")
    ax.set_ylim(0, 1)
    ax.set_title(f"failures per fault site ({summary.runs} runs)")
    ax.tick_params(axis="x", labelrotation=45)
    ax.legend()
    fig.tight_layout()
    path = folder / PLOTS[0]
    data = {
        s: {
            "armed": summary.armed[s],
            "fired": summary.fired[s],
            "failed": summary.failed_when_armed[s],
            "implicated": summary.implicated[s],
            "rate": round(r, 4),
            "implicated_rate": round(i, 4),
        }
        for s, r, i in zip(sites, rates, implicated)
    }
    _save(plt, fig, path, data)
    written.append(path)

    configs = sorted(summary.by_config)
    verdicts = sorted(summary.verdicts)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(configs) + 2), 4))
    bottom = [0] * len(configs)
    labels = [f"{st}\n{pr}" for st, pr in configs]
    colours = {"pass": "#27ae60", "safety": "#c0392b", "liveness": "#e67e22", "crash": "#8e44ad"}
    for v in verdicts:
        counts = [summary.by_config[c].get(v, 0) for c in configs]
        ax.bar(labels, counts, bottom=bottom, label=v, color=colours.get(v, "#7f8c8d"))
        bottom = [b + n for b, n in zip(bottom, counts)]
    ax.set_ylabel("runs")
    ax.set_title("verdicts per strategy x profile")
    ax.legend()
    fig.tight_layout()
    path = folder / PLOTS[1]
    data = {f"{st}/{pr}": dict(sorted(summary.by_config[(st, pr)].items())) for st, pr in configs}
    _save(plt, fig, path, data)
    written.append(path)
    return written
