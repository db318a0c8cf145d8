"""Loss normalisation: each micro-batch's loss is summed, and the optimizer step divides by the units
(rows or target tokens) of the whole accumulation window, so k micro-batches x 1 equals 1 x k exactly."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

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


def accumulate_window(model: torch.nn.Module, micro_batches: list[Batch], task: str,
                      accelerator: Any = None, *, denominator: int | None = None, scale: float = 1.0,
                      between: Callable[[], None] | None = None) -> float:
    """Forward and backward every micro-batch of one effective batch. The gradients left in .grad are
    those of the loss averaged over the whole effective batch. Returns that loss. `between()` is called
    before each micro-batch (a requested stop raises there).
    Across processes (see shard_window) `denominator` is the count over the whole *global* effective
    batch and `scale` multiplies what is backpropagated (not the loss returned)."""
    if denominator is None:
        denominator = max(sum(loss_units(mb, task) for mb in micro_batches), 1)
    total = None  # kept on the device: reading it once per step, not per micro-batch, keeps a GPU busy
    for k, mb in enumerate(micro_batches):
        if between is not None:
            between()
        is_accumulating = k < len(micro_batches) - 1
        # across GPUs, gradients are only synchronised on the last micro-batch
        sync = accelerator.no_sync(model) if (accelerator is not None and is_accumulating) \
            else contextlib.nullcontext()
        with sync:
            loss = summed_loss(model, mb, task) / denominator
            scaled = loss * scale if scale != 1.0 else loss
            if accelerator is not None:
                accelerator.backward(scaled)
            else:
                scaled.backward()
        total = loss.detach().float() if total is None else total + loss.detach().float()
    return float(total) if total is not None else 0.0
