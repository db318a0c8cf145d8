"""Optimizer, learning-rate schedule and gradient norm for the train stage."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from stages.engine.errors import MissingInputError


def make_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float, device: torch.device,
                   log: logging.Logger) -> torch.optim.Optimizer:
    """adam (the BLOOM article's) | adamw_torch | adamw_8bit | paged_adamw_8bit (bitsandbytes). Weight
    decay applies to matrices only, not to biases and norm weights (nanoGPT)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise MissingInputError("train: the model has no trainable parameters; check the adapters stage "
                                "(adapters.method, adapters.target_modules)")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if name == "adamw_torch":
        return torch.optim.AdamW(groups, lr=lr)
    import bitsandbytes as bnb

    if name == "paged_adamw_8bit":
        if device.type == "cuda":
            return bnb.optim.PagedAdamW8bit(groups, lr=lr)
        log.warning("train.optimizer paged_adamw_8bit: paging needs CUDA; on %s using non-paged adamw_8bit "
                    "(same update rule)", device.type)
    return bnb.optim.AdamW8bit(groups, lr=lr)


def lr_factor(step: int, schedule: str, warmup: int, total: int) -> float:
    """Multiplier of the base LR at optimizer step `step`: linear warmup, then constant/linear/cosine."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    frac = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - frac)
    return 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))  # cosine


def make_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup: int, total: int) -> Any:
    def factor(step: int) -> float:  # a plain function: the scheduler's state_dict stays tensors/numbers
        return lr_factor(step, schedule, warmup, total)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def grad_norm(model: torch.nn.Module, accelerator: Any, max_norm: float | None) -> float:
    """The gradients' total L2 norm *before* clipping (the first thing to look at when training goes
    wrong), clipping them to `max_norm` when set. Gradients a grad scaler multiplied are unscaled first
    (the scaler's step then does not unscale them twice)."""
    if max_norm:
        return float(accelerator.clip_grad_norm_(model.parameters(), max_norm))
    if accelerator.scaler is not None:
        accelerator.unscale_gradients()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
