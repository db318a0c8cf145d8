"""A train artifact's metrics.jsonl read back: one record per logged step (`kind` train, the default, with
`loss`) or validation (`kind` validation, with `val_loss` and `val_accuracy`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.engine.runs import metrics_records, read_metrics
from stages.engine.store import Store


def stored_history(store: Store, key: str) -> list[dict[str, Any]]:
    """The history of the store's train artifact `key`, its metrics.jsonl read alone (on a shared store,
    the artifact's weights stay there)."""
    raw = store.read_file("train", key, "metrics.jsonl")
    return [] if raw is None else metrics_records(raw.decode("utf-8", errors="replace"))


def read_history(folder: Path) -> list[dict[str, Any]]:
    """The records with a step of the train artifact in `folder`."""
    return read_metrics(folder / "metrics.jsonl")


def train_losses(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training records that carry a loss."""
    return [r for r in history if r.get("kind", "train") == "train" and isinstance(r.get("loss"), int | float)]
