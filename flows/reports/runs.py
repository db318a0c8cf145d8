"""`python -m flows.inspect runs [PIPELINE] [--sweep NAME] [--json | --csv]`: every run the store saw, oldest
first (like `dvc exp show`): when, the pipeline, its `--set` list (what differs from the pipeline file),
each stage's outcome (C computed, c cached, F failed, - not run), key metrics, train time, how it ended.
Read from the run records (stages/engine/runs.py); Prefect is not imported."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from flows.reports.formatting import local_time, number, render_table
from stages.engine.runs import read_runs, records_root
from stages.engine.status import headline
from stages.graph import GRAPH

MARKS = {"computed": "C", "cached": "c", "failed": "F", "joined": "J"}


def select(runs: list[dict[str, Any]], pipeline: str | None, sweep: str | None) -> list[dict[str, Any]]:
    return [r for r in runs if (pipeline is None or r.get("pipeline") == pipeline)
            and (sweep is None or r.get("sweep") == sweep)]


def key_metrics(run: dict[str, Any]) -> dict[str, Any]:
    """The headline metrics of the stages the record kept metrics of (`Stage.reports`): a name two stages
    have is the later stage's (evaluate's accuracy, not train's)."""
    out: dict[str, Any] = {}
    metrics = run.get("metrics") or {}
    for stage in reversed([s.name for s in GRAPH if s.name in metrics]):
        for k, v in headline(metrics[stage], GRAPH[stage].headline).items():
            out.setdefault(k, v)
    return out


def rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in runs:
        stages = {s["stage"]: s for s in r.get("stages") or [] if isinstance(s, dict) and "stage" in s}
        out.append({"started": r.get("started"), "id": r.get("id"), "pipeline": r.get("pipeline"),
                    "sweep": r.get("sweep"), "set": r.get("set") or [], "status": r.get("status"),
                    "stages": {s: v.get("status") for s, v in stages.items()},
                    "metrics": key_metrics(r), "train_seconds": r.get("train_seconds"), "error": r.get("error")})
    return out


def stage_names(table: list[dict[str, Any]]) -> list[str]:
    """Every stage the runs ran, in the order they ran them."""
    return list(dict.fromkeys(s for r in table for s in r["stages"]))


def fmt(v: Any) -> str:
    return "-" if v is None else number(v)


def render(table: list[dict[str, Any]]) -> str:
    if not table:
        return "no runs recorded in this store yet"
    names = stage_names(table)
    head = ["started", "pipeline", "stages", "status", "train s", "metrics", "--set"]
    lines = [head]
    for r in table:
        marks = "".join(MARKS.get(r["stages"].get(s, ""), "-") for s in names)
        metrics = " ".join(f"{k}={fmt(v)}" for k, v in r["metrics"].items())
        pipeline = r["pipeline"] + (f" [{r['sweep']}]" if r["sweep"] else "")
        lines.append([local_time(r["started"]), pipeline, marks, r["status"] or "-",
                      fmt(r["train_seconds"]), metrics, " ".join(r["set"])])
    legend = f"stages: {' '.join(names)} (C computed, c cached, F failed, J joined another machine's run, - not run)"
    return render_table(lines) + "\n" + legend


def to_csv(table: list[dict[str, Any]]) -> str:
    metric_names = sorted({k for r in table for k in r["metrics"]})
    stages = stage_names(table)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["started", "id", "pipeline", "sweep", "status", "set", *stages, "train_seconds", *metric_names])
    for r in table:
        w.writerow([r["started"], r["id"], r["pipeline"], r["sweep"] or "", r["status"], " ".join(r["set"]),
                    *[r["stages"].get(s, "") for s in stages], r["train_seconds"] or "",
                    *[r["metrics"].get(k, "") for k in metric_names]])
    return buf.getvalue().rstrip("\n")


def report(store: Any, pipeline: str | None = None, sweep: str | None = None, as_json: bool = False,
           as_csv: bool = False) -> str:
    table = rows(select(read_runs(records_root(store)), pipeline, sweep))
    if as_json:
        return json.dumps(table, indent=2)
    return to_csv(table) if as_csv else render(table)
