"""The history of the stage that trains (its `Stage.history`, metrics.jsonl) read back: one record per logged
step (`kind` train, the default, with `loss`) or validation (`kind` validation, with `val_loss` and
`val_accuracy`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.engine.runs import metrics_records, read_metrics
from stages.engine.stage import Stage
from stages.engine.store import Store
from stages.facts import STEP_RECORD


def stored_history(store: Store, stage: Stage[Any], key: str) -> list[dict[str, Any]]:
    """The history of the stage's artifact `key`, its history file read alone (on a shared store, the
    artifact's weights stay there); [] for a stage that keeps none."""
    raw = store.read_file(stage.name, key, stage.history) if stage.history else None
    return [] if raw is None else metrics_records(raw.decode("utf-8", errors="replace"))


def read_history(path: Path) -> list[dict[str, Any]]:
    """The records with a step of a history file (an artifact's `Stage.history`)."""
    return read_metrics(path)


def train_losses(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training records that carry a loss."""
    return [r for r in history if r.get("kind", STEP_RECORD) == STEP_RECORD and isinstance(r.get("loss"), int | float)]
