"""A train artifact's metrics.jsonl read back: one record per logged step (`kind` train, the default, with
`loss`) or validation (`kind` validation, with `val_loss` and `val_accuracy`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_history(folder: Path) -> list[dict[str, Any]]:
    """The records with a step; an unreadable line is skipped (a run killed mid-write leaves half a line)."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            out.append(rec)
    return out


def train_losses(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training records that carry a loss."""
    return [r for r in history if r.get("kind", "train") == "train" and isinstance(r.get("loss"), int | float)]
