"""Row access to a tokenized split (the train stage's batches are cut from it) and the validation pass
over one."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from stages.common.batching import Batch, collate, split_micro
from stages.common.losses import loss_units, summed_loss


class Rows:
    """Row access to a tokenized split (a datasets.Dataset or a list of dicts, for tests)."""

    def __init__(self, ds: Any):
        self.ds = ds
        if isinstance(ds, list):
            self.lengths = [len(r["input_ids"]) for r in ds]
        else:
            cols = ds.column_names
            self.lengths = list(ds["length"]) if "length" in cols else [len(x) for x in ds["input_ids"]]

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, idx: list[int]) -> list[dict]:
        if isinstance(self.ds, list):
            return [self.ds[i] for i in idx]
        cols = self.ds[idx]
        return [{"input_ids": cols["input_ids"][j], "labels": cols["labels"][j]} for j in range(len(idx))]

    def batches(self, idx: list[int], micro: int, pad_id: int, task: str) -> list[Batch]:
        return [collate(self.get(mb), pad_id, task) for mb in split_micro(idx, self.lengths, micro)]


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
