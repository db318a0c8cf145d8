"""The train stage's optimizers, by name (train.optimizer), and its learning-rate schedule."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch


def _adamw_8bit(groups: list[dict[str, Any]], lr: float, device: torch.device,
                log: logging.Logger) -> torch.optim.Optimizer:
    import bitsandbytes as bnb  # optional: only the 8-bit optimizers need it (train_checks says so at plan time)

    return bnb.optim.AdamW8bit(groups, lr=lr)


def _paged_adamw_8bit(groups: list[dict[str, Any]], lr: float, device: torch.device,
                      log: logging.Logger) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    if device.type == "cuda":
        return bnb.optim.PagedAdamW8bit(groups, lr=lr)
    log.warning("train.optimizer paged_adamw_8bit: paging needs CUDA; on %s using non-paged adamw_8bit "
                "(same update rule)", device.type)
    return bnb.optim.AdamW8bit(groups, lr=lr)


# train.optimizer -> its constructor (parameter groups, lr, device, log). The names are the schema's choices
# (TrainConfig.optimizer, checked when the config loads); tests/stages/test_train.py keeps the two equal.
OPTIMIZERS: dict[str, Callable[[list[dict[str, Any]], float, torch.device, logging.Logger], torch.optim.Optimizer]] = {
    "adam": lambda groups, lr, device, log: torch.optim.Adam(groups, lr=lr),  # the BLOOM article's
    "adamw_torch": lambda groups, lr, device, log: torch.optim.AdamW(groups, lr=lr),
    "adamw_8bit": _adamw_8bit,  # bitsandbytes: 8-bit states
    "paged_adamw_8bit": _paged_adamw_8bit,  # ... paged to CPU memory under GPU memory pressure
}


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
