"""A sweep's comparison written into its folder of the store, `sweeps/<name>/`: the table (comparison.md), the
variants and runs (comparison.json, runs.csv) and a chart (chart.png): the metric per variant, one dot per seed,
and every run's training loss overlaid. The sweep flow links the chart from a markdown artifact."""

from __future__ import annotations

import json
from pathlib import Path

from flows.reports.comparison import Comparison, is_share, pm, render, runs_csv
from flows.reports.formatting import inline_png
from flows.reports.train_history import stored_history, train_losses
from flows.reports.variants import sweep_dir
from stages.engine.store import Store
from stages.facts import TRAINS
from stages.graph import GRAPH


def write_outputs(c: Comparison, store: Store) -> dict[str, Path]:
    folder = sweep_dir(store, c.sweep.name)
    folder.mkdir(parents=True, exist_ok=True)
    files = {"table": folder / "comparison.md", "json": folder / "comparison.json", "csv": folder / "runs.csv",
             "chart": folder / "chart.png"}
    files["table"].write_text(render(c) + "\n")
    files["json"].write_text(json.dumps(c.to_json(), indent=2, default=str))
    files["csv"].write_text(runs_csv(c))
    plot(c, store, files["chart"])
    return files


def plot(c: Comparison, store: Store, out: Path) -> None:
    """Left: the metric per variant (mean, sd bar, one dot per seed). Right: every run's training loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = c.sweep.config.metric
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, v in enumerate(c.variants):
        color = colors[i % len(colors)]
        vals = v.values()
        if vals:
            ax1.bar(i, v.mean(), yerr=v.sd() or 0, color=color, alpha=0.6, capsize=4)
            ax1.scatter([i] * len(vals), vals, color="black", s=12, zorder=3)
            ax1.annotate(f"{pm(v.mean(), v.sd(), is_share(m))} (n={len(vals)})", (i, max(vals)),
                         textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        for r in v.runs:
            trains = next((s for s in GRAPH if s.role == TRAINS and s.name in r.keys), None)
            if trains is not None:
                curve = [(p["step"], p["loss"]) for p in
                         train_losses(stored_history(store, trains, r.keys[trains.name]))]
                if curve:
                    ax2.plot(*zip(*curve, strict=True), color=color, alpha=0.7, linewidth=1,
                             label=v.variant if r is v.runs[0] else None)
    ax1.set_xticks(range(len(c.variants)), [v.variant for v in c.variants], rotation=20, ha="right", fontsize=8)
    ax1.set_ylabel(m)
    done = [x for v in c.variants for x in v.values()]
    if done:
        lo, hi = min(done), max(done)
        ax1.set_ylim(lo - 0.2 * (hi - lo + 1e-3) - 0.01, hi + 0.2 * (hi - lo + 1e-3) + 0.01)
    ax1.set_title(f"{c.sweep.name}: {m} per variant")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("training loss")
    ax2.set_title("loss curves")
    if ax2.lines:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def chart_markdown(c: Comparison, files: dict[str, Path]) -> str:
    png = files["chart"]
    lines = [f"### sweep {c.sweep.name}", "", render(c), ""]
    lines += inline_png(png, f"{c.sweep.config.metric} per variant, loss curves")
    lines += [f"chart: `{png}`", f"table: `{files['table']}` · runs: `{files['csv']}` · `{files['json']}`"]
    return "\n".join(lines)
