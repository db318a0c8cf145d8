"""The device side of training: precision, accelerate's Accelerator, fp32 master weights, gradient
checkpointing, seeding, and recognising an out-of-memory error."""

from __future__ import annotations

import gc
import logging
import random
from typing import Any

import numpy as np
import torch

from stages.common.compat.accelerate import reset_accelerator_state
from stages.engine.errors import ConfigError


def resolve_precision(setting: str, device: torch.device) -> str:
    """auto: bf16 on GPUs that have it, fp16 (+ grad scaler) on older GPUs, fp32 ("no") on CPU
    (bf16 matmuls are ~80x slower on these CPUs)."""
    if setting == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "no"
    if setting == "fp16" and device.type != "cuda":
        raise ConfigError("train.mixed_precision: fp16 needs a CUDA GPU; use auto (fp32 on CPU) or bf16")
    return setting


def make_accelerator(mixed_precision: str, log: logging.Logger) -> tuple[Any, str]:
    from accelerate import Accelerator

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve_precision(mixed_precision, device)
    reset_accelerator_state()  # several trainings in one process (tests, bench) may differ
    # accumulation is ours (token-normalised), so accelerate's own is left at 1
    accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=1, cpu=device.type == "cpu")
    log.info("train: device %s, mixed precision %s (setting %s)", accelerator.device, precision, mixed_precision)
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
