"""The validation pass over a tokenized split: its rows, and the mean loss (and accuracy) over them."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from stages.common.batching import Rows, collate
from stages.common.losses import loss_units, summed_loss


def validation_rows(val_ds: Any, max_examples: int | None) -> Rows | None:
    """The validation split's rows (its first `max_examples`), None when there are none."""
    if val_ds is None or not len(val_ds):
        return None
    if max_examples is not None and max_examples < len(val_ds):
        val_ds = val_ds[:max_examples] if isinstance(val_ds, list) else val_ds.select(range(max_examples))
    return Rows(val_ds)


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, rows: Rows, task: str, pad_id: int, batch_size: int,
                  device: torch.device) -> dict[str, float]:
    """Validation: mean loss (per row or per target token) and, for classification, accuracy; both
    accumulated as counts batch by batch (memory does not grow with the split)."""
    was_training = model.training
    model.eval()
    loss_sum, units, correct = 0.0, 0, 0
    order = sorted(range(len(rows)), key=lambda i: rows.lengths[i])
    for i in range(0, len(order), batch_size):
        b = collate(rows.get(order[i:i + batch_size]), pad_id, task).to(device)
        if task == "seq_cls":
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()
            loss_sum += float(F.cross_entropy(logits, b.labels, reduction="sum"))
            correct += int((logits.argmax(-1) == b.labels).sum())
        else:
            loss_sum += float(summed_loss(model, b, task))
        units += loss_units(b, task)
    model.train(was_training)
    out = {"val_loss": round(loss_sum / max(units, 1), 6)}
    if task == "seq_cls":
        out["val_accuracy"] = round(correct / max(len(rows), 1), 6)
    return out
