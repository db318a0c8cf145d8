"""Loss normalisation: each micro-batch's loss is summed, and the optimizer step (stages/train.py) divides by
the units (rows or target tokens) of the whole accumulation window, so k micro-batches x 1 equals 1 x k exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.common.batching import IGNORE_INDEX, Batch


def loss_units(batch: Batch, task: str) -> int:
    """What the loss is averaged over: rows for classification, target tokens for LM tasks."""
    if task == "seq_cls":
        return len(batch)
    labels = batch.labels[:, 1:] if task == "causal_lm" else batch.labels
    return int((labels != IGNORE_INDEX).sum())


def summed_loss(model: torch.nn.Module, batch: Batch, task: str) -> torch.Tensor:
    """The loss of a micro-batch, summed (not averaged) over its rows or target tokens."""
    if task == "seq_cls":
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return F.cross_entropy(logits.float(), batch.labels, reduction="sum")
    if task == "seq2seq":  # labels make the model build decoder inputs (shift right); we compute the loss
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).logits
        targets = batch.labels
    else:  # causal LM: token t predicts token t+1
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        targets = batch.labels[:, 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
