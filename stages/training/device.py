"""The device side of training: precision (resolved in stages/models/precision.py, autocast here), accelerate's
Accelerator, fp32 master weights, gradient checkpointing, seeding, and recognising an out-of-memory error.
Stages (and predict) import resolve_precision, autocast and training_device from here."""

from __future__ import annotations

import contextlib
import gc
import logging
import random
from typing import Any

import numpy as np
import torch

from stages.models.compat.accelerate import reset_accelerator_state
from stages.models.precision import Precision, device_type, resolve_precision

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def training_device() -> torch.device:
    """The device the train stage (and evaluate, predict) computes on: the GPU when there is one."""
    return torch.device(device_type())


def autocast(precision: Precision | str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast in `precision` (a Precision or its name) on `device`; fp32: a no-op."""
    dtype = AUTOCAST_DTYPES.get(precision.name if isinstance(precision, Precision) else precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def make_accelerator(mixed_precision: str, log: logging.Logger) -> tuple[Any, Precision]:
    from accelerate import Accelerator

    device = training_device()
    precision = resolve_precision(mixed_precision, device)
    reset_accelerator_state()  # several trainings in one process (tests, bench) may differ
    # accumulation is ours (token-normalised), so accelerate's own is left at 1
    accelerator = Accelerator(mixed_precision=precision.name, gradient_accumulation_steps=1,
                              cpu=device.type == "cpu")
    log.info("train: device %s, mixed precision %s (%s)", accelerator.device, precision.name, precision.reason)
    return accelerator, precision


def enable_gradient_checkpointing(model: torch.nn.Module, log: logging.Logger) -> None:
    """The one place that turns gradient checkpointing on (non-reentrant: frozen inputs need no
    enable_input_require_grads), except for k-bit models, where models.load_trainable's
    prepare_model_for_kbit_training already did. Either way the KV cache goes off (useless in training)."""
    flag = "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else "is_gradient_checkpointing"
    if not getattr(model, flag, False):
        # transformers 5 renamed gradient_checkpointing_enable to activation_checkpointing_enable
        if (enable := getattr(model, "activation_checkpointing_enable", None)) is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif (enable := getattr(model, "gradient_checkpointing_enable", None)) is not None:
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            log.warning("train.gradient_checkpointing: %s does not support it; ignored", type(model).__name__)
            return
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False


def upcast_trainable(model: torch.nn.Module, log: logging.Logger) -> None:
    """Mixed precision keeps fp32 master weights: half-precision trainable weights would break the grad
    scaler and lose small updates."""
    n = 0
    for p in model.parameters():
        if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()
            n += 1
    if n:
        log.info("train: %d trainable tensors upcast to fp32 (master weights)", n)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def release_memory() -> None:
    """What an out-of-memory retry frees first: Python garbage, then the CUDA allocator's cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
