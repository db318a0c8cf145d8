"""Run records: one JSON file per pipeline run under the store's `runs/`, for `python -m flows.inspect runs`.

A record is written when the run starts and rewritten (atomically) after each stage and at the end:
when, the pipeline, its `--set` list, the sweep it belongs to (FINETUNE_SWEEP, set by a sweep for its
runs), per stage in the order run its outcome (computed / cached / failed) with key and seconds, the key metrics of the
stages the graph marks `Stage.reports` (numbers only), the train time (a `train_seconds` metric), and how the run ended (completed / failed /
interrupted; `running` while it runs, or when its process died).
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.engine.hooks import Hook
from stages.engine.store import Outcome, now_iso, write_json_atomic

if TYPE_CHECKING:
    from stages.engine.hooks import Run

SWEEP_ENV = "FINETUNE_SWEEP"


class RunRecord:
    """`metric_stages`: the stages whose metrics the record keeps (the graph's `Stage.reports`)."""

    def __init__(self, root: Path, pipeline: str, overrides: list[str], selection: dict[str, Any],
                 metric_stages: list[str]):
        self.metric_stages = metric_stages
        started = now_iso()
        self.path = root / "runs" / f"{started.replace(':', '').replace('-', '')[:15]}-{uuid.uuid4().hex[:8]}.json"
        self.data: dict[str, Any] = {
            "id": self.path.stem, "started": started, "ended": None, "pipeline": pipeline,
            "set": list(overrides), "sweep": os.environ.get(SWEEP_ENV) or None, "status": "running",
            "host": socket.gethostname(), "pid": os.getpid(), "selection": selection, "stages": [],
            "metrics": {}, "train_seconds": None, "error": None}
        self.save()

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, self.data)
        except OSError:  # a history that cannot be written never stops a run
            pass

    def stage(self, o: Outcome) -> None:
        manifest = o.manifest or {}  # none on this machine for a stage that joined another machine's run
        metrics = manifest.get("metrics")
        status = outcome_status(o)
        self.data["stages"].append({"stage": o.stage, "status": status, "key": o.key,
                                    "duration_s": manifest.get("duration_s")})
        if o.stage in self.metric_stages and isinstance(metrics, dict):
            self.data["metrics"][o.stage] = scalars(metrics)
            if "train_seconds" in metrics:
                self.data["train_seconds"] = metrics["train_seconds"]
        self.save()

    def failed(self, stage: str | None, err: BaseException) -> None:
        if stage is not None:
            self.data["stages"].append({"stage": stage, "status": "failed"})
        self.end("failed" if isinstance(err, Exception) else "interrupted", f"{type(err).__name__}: {err}")

    def end(self, status: str = "completed", error: str | None = None) -> None:
        self.data.update(status=status, ended=now_iso(), error=error)
        self.save()


class RunRecords(Hook):
    """The run history as a hook: the record is written when the run starts (its id joins the run's tags),
    after each stage and when the run ends."""

    record: RunRecord

    def before_run(self, run: Run) -> None:
        plan = run.plan
        self.record = RunRecord(records_root(run.store), plan.cfg.name, plan.cfg.overrides, plan.selection(),
                                [s.name for s in plan.graph if s.reports])
        run.tags["finetune.run_record"] = self.record.data["id"]

    def after_stage(self, run: Run, outcome: Outcome) -> None:
        self.record.stage(outcome)

    def on_error(self, run: Run, stage: str | None, error: BaseException) -> None:
        self.record.failed(stage, error)

    def after_run(self, run: Run, status: str) -> None:
        if (moved := run.transfers()) is not None:
            self.record.data["transfers"] = moved
        if status == "FINISHED":
            self.record.end()
        else:  # failed() wrote the end; the transfers too
            self.record.save()


def outcome_status(o: Outcome) -> str:
    """computed, cached, or joined (trained with another machine, which commits the artifact)."""
    return "joined" if o.reason == "joined" else "computed" if o.computed else "cached"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file that carry a step (metrics_records); [] when it is absent."""
    return metrics_records(path.read_text()) if path.is_file() else []


def metrics_records(text: str) -> list[dict[str, Any]]:
    """The records of metrics.jsonl text that carry a step, in order; an unreadable line is skipped (a run
    killed mid-write leaves half a line)."""
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            out.append(rec)
    return out


def scalars(metrics: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The numbers of a stage's metrics, flat with dotted names (of a list of records, the last record's:
    train's validation history), not its tables."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, list) and v and isinstance(v[-1], dict):
            v = v[-1]
        if isinstance(v, dict):
            out.update(scalars(v, f"{prefix}{k}."))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
    return out


def records_root(store: Any) -> Path:
    """The folder that holds runs/: the store's own, a shared store's local cache (records stay per machine)."""
    return store.root


def read_runs(root: Path) -> list[dict[str, Any]]:
    """Every run record under root/runs, oldest first (unreadable files skipped)."""
    out = []
    for f in sorted((root / "runs").glob("*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda r: r.get("started") or "")
