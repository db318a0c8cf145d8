"""What the Prefect UI shows of each stage: a table artifact of its manifest under a stable key
(`<pipeline>-<stage>`), the train stage's loss curve, the evaluate stage's metrics, what export wrote.
Published when a stage computes, by a hook the flow hangs on its run (`UIArtifacts`); a store hit uploads
nothing (its task ends `Cached` with the key in its message), so a fully cached rerun makes no artifact
requests."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.orchestration import api_watch
from flows.reports.formatting import inline_png, number
from flows.reports.train_history import read_history, train_losses
from stages.engine.hooks import Hook, Run
from stages.engine.stage import Stage
from stages.engine.store import Outcome
from stages.facts import EVALUATES, SHIPS, TRAINS


class UIArtifacts(Hook):
    """Each computed stage's artifacts in the UI, as it finishes (not while the Prefect server is gone: each
    upload would wait a minute of retries on it)."""

    def after_stage(self, run: Run, outcome: Outcome) -> None:
        if outcome.computed and not api_watch.gone():
            publish(run.plan.cfg.name, outcome, run.plan.graph[outcome.stage])


def artifact_key(pipeline: str, stage: str) -> str:
    """Stable per pipeline and stage, so the UI shows each stage's history."""
    raw = f"{pipeline}-{stage}".lower()
    return "".join(c if c.isalnum() or c == "-" else "-" for c in raw)


def publish(pipeline: str, o: Outcome, stage: Stage[Any] | None = None) -> None:
    """A table artifact of the stage's manifest under the stable key `<pipeline>-<stage>`; by the stage's role
    (stages/facts.py), the stage that trains adds its loss curve (`-<stage>-loss`), the one that evaluates its
    metrics (`-<stage>-metrics`), the one that ships the model what it wrote (`-<stage>-files`). An artifact
    that cannot be built is a warning, never a failed stage."""
    status = "computed" if o.computed else "cached"
    role = stage.role if stage is not None else None
    try:
        create_table_artifact(table=manifest_rows(o), key=artifact_key(pipeline, o.stage),
                              description=f"{pipeline} / {o.stage}: {status}")
        if role == TRAINS and stage is not None and stage.history and (md := train_loss_markdown(o, stage.history)):
            create_markdown_artifact(markdown=md, key=artifact_key(pipeline, f"{o.stage}-loss"),
                                     description=f"{pipeline} / {o.stage}: loss curve ({status})")
        elif role == EVALUATES and (rows := evaluate_rows(o.manifest.get("metrics"))):
            create_table_artifact(table=rows, key=artifact_key(pipeline, f"{o.stage}-metrics"),
                                  description=f"{pipeline} / {o.stage}: metrics ({status})")
        elif role == SHIPS and (rows := export_rows(o)):
            command = (o.manifest.get("metrics") or {}).get("command")
            create_table_artifact(table=rows, key=artifact_key(pipeline, f"{o.stage}-files"),
                                  description=f"{pipeline} / {o.stage}: what it wrote ({status}) under {o.path}"
                                  + (f"; reproduce: `{command}`" if isinstance(command, str) else ""))
    except Exception as e:  # a UI extra must never fail a committed stage
        logging.getLogger("finetune").warning("%s: artifact for the UI not published: %s", o.stage, e)


def manifest_rows(o: Outcome) -> list[dict[str, Any]]:
    m = o.manifest
    files = m.get("files") or []
    rows: list[dict[str, Any]] = [
        {"field": "status", "value": "computed" if o.computed else "cached"},
        {"field": "key", "value": o.key},
        {"field": "path", "value": str(o.path)},
        {"field": "created", "value": m.get("finished_at")},
        {"field": "duration_s", "value": m.get("duration_s")},
        {"field": "size_bytes", "value": sum(f.get("size", 0) for f in files)},
        {"field": "files", "value": len(files)},
    ]
    for name, value in (m.get("metrics") or {}).items():
        if isinstance(value, int | float | str):
            rows.append({"field": name, "value": value})
        elif isinstance(value, dict | list) and len(str(value)) < 400:
            rows.append({"field": name, "value": str(value)})
    return rows


def train_loss_markdown(o: Outcome, history_file: str, max_rows: int = 40) -> str | None:
    """The loss curve (loss.png, inlined) and the loss history (`history_file`) as a table, thinned to max_rows."""
    history = read_history(o.path / history_file)
    train = train_losses(history)
    val = {r["step"]: r for r in history if r.get("kind") == "validation"}
    metrics = o.manifest.get("metrics") or {}
    if not train and not val and "final_loss" not in metrics:
        return None
    lines = [f"### {o.stage} loss ({'computed' if o.computed else 'cached'}, key `{o.key[:12]}`)", ""]
    facts = [f"{k} = {number(metrics[k])}" for k in ("steps", "first_loss", "final_loss", "effective_batch",
                                                    "tokens_per_s") if k in metrics]
    if facts:
        lines += [" · ".join(facts), ""]
    png = o.path / "loss.png"
    lines += inline_png(png, "loss curve")
    if png.is_file():
        lines += [f"curve: `{png}`", ""]
    if train:
        stride = max(1, -(-len(train) // max_rows))
        shown = train[::stride] if train[-1] in train[::stride] else [*train[::stride], train[-1]]
        lines += ["| step | loss | validation loss | validation accuracy |", "|---:|---:|---:|---:|"]
        for r in shown:
            v = val.get(r["step"], {})
            lines.append(f"| {r['step']} | {number(r['loss'])} | {number(v.get('val_loss', ''))} | "
                         f"{number(v.get('val_accuracy', ''))} |")
    return "\n".join(lines)


def evaluate_rows(metrics: Any) -> list[dict[str, Any]]:
    """One row per split (metrics["splits"] = {split: {metric: value}}, scalars only; the confusion matrix
    stays in the manifest), else one row per (dotted) metric."""
    if not isinstance(metrics, dict):
        return []
    splits = metrics.get("splits")
    if isinstance(splits, dict) and splits and all(isinstance(v, dict) for v in splits.values()):
        return [{"split": name, **{k: v for k, v in values.items() if isinstance(v, int | float | str)}}
                for name, values in splits.items()]
    rows: list[dict[str, Any]] = []

    def walk(value: Any, name: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{name}.{k}" if name else str(k))
        elif isinstance(value, int | float | str) and len(rows) < 200:
            rows.append({"metric": name, "value": value})

    walk(metrics, "")
    return rows


def export_rows(o: Outcome) -> list[dict[str, Any]]:
    """What the export wrote, one row per top-level entry of its folder: absolute path, files, bytes."""
    groups: dict[str, list[int]] = {}
    for f in o.manifest.get("files") or []:
        top = Path(f["path"]).parts[0]
        groups.setdefault(top, []).append(int(f.get("size") or 0))
    return [{"path": str(o.path / top), "files": len(sizes), "size_bytes": sum(sizes)}
            for top, sizes in sorted(groups.items())]

