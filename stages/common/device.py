"""The device side of training: precision, accelerate's Accelerator, fp32 master weights, gradient
checkpointing, seeding, and recognising an out-of-memory error."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stages.engine.errors import ConfigError

# The CPU's bf16 matmul units, by their names in torch.cpu.get_capabilities() (the /proc/cpuinfo flags):
# AMX tiles (Intel Sapphire Rapids and later) and AVX512-BF16 dot products (Intel Cooper Lake, AMD Zen 4 and
# later). oneDNN runs bf16 matmuls on them; without them it converts to fp32 and back, many times slower
# (torch.ops.mkldnn._is_mkldnn_bf16_supported() is true from plain AVX512 on, so it cannot tell). Measured on
# one thread, bf16 vs fp32: AVX512-BF16 alone (AMD EPYC Zen 4) a 1024^2 matmul 2.6x faster, a MiniLM training
# step (8 x 256 tokens, AdamW) 1.6x; with AMX (issue 23's machine) 12x and 1.28x. Arm's bf16 extensions are
# not counted: not measured here.
CPU_BF16_UNITS = ("amx_bf16", "avx512_bf16")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# Names the CPU's bf16 units instead of detecting them, comma-separated ("": none). The test suite sets it
# empty, so its numbers do not depend on the machine's CPU; safe for the cache, as the precision each run
# resolves to is in the keys.
UNITS_ENV = "FINETUNE_CPU_BF16_UNITS"


def cpu_bf16_units() -> tuple[str, ...]:
    """The bf16 matmul units this CPU has (empty: none), from torch.cpu.get_capabilities() (cpuinfo)."""
    if (named := os.environ.get(UNITS_ENV)) is not None:
        return tuple(u for u in (x.strip() for x in named.split(",")) if u)
    caps = torch.cpu.get_capabilities()
    return tuple(u for u in CPU_BF16_UNITS if caps.get(u))


@dataclass(frozen=True)
class Precision:
    """The precision a stage computes in and why: `name` as train.mixed_precision spells it (no: fp32)."""

    name: str  # "no" | "bf16" | "fp16"
    reason: str

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype; None for fp32."""
        return AUTOCAST_DTYPES.get(self.name)


def auto_precision(device: torch.device) -> Precision:
    """What `auto` picks on this device, from its capabilities (never from a timing)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Precision("bf16", "the GPU supports bf16")
        return Precision("fp16", "the GPU has no bf16: fp16 with a gradient scaler")
    if units := cpu_bf16_units():
        return Precision("bf16", f"the CPU has bf16 units ({', '.join(units)})")
    return Precision("no", f"the CPU has no bf16 units ({' or '.join(CPU_BF16_UNITS)}): bf16 would be emulated, "
                     "many times slower than fp32")


def resolve_precision(setting: str, device: torch.device) -> Precision:
    """train.mixed_precision on `device`. auto: bf16 on GPUs that have it, fp16 (+ grad scaler) on older
    GPUs; on CPU bf16 where it has bf16 units (CPU_BF16_UNITS), else fp32 ("no")."""
    auto = auto_precision(device)
    if setting == "auto":
        return Precision(auto.name, f"auto: {auto.reason}")
    if setting == "fp16" and device.type != "cuda":
        raise ConfigError("train.mixed_precision: fp16 needs a CUDA GPU; use auto (bf16 on CPUs with bf16 units, "
                          "else fp32) or bf16")
    if setting == auto.name:
        return Precision(setting, f"as auto would choose: {auto.reason}")
    return Precision(setting, f"set (auto would choose {auto.name}: {auto.reason})")


def training_device() -> torch.device:
    """The device the train stage (and evaluate, predict) computes on: the GPU when there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast(precision: Precision | str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast in `precision` (a Precision or its name) on `device`; fp32: a no-op."""
    dtype = AUTOCAST_DTYPES.get(precision.name if isinstance(precision, Precision) else precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def make_accelerator(mixed_precision: str, log: logging.Logger) -> tuple[Any, Precision]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    device = training_device()
    precision = resolve_precision(mixed_precision, device)
    AcceleratorState._reset_state(True)  # several trainings in one process (tests, bench) may differ
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
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False


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
