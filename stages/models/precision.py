"""Which precision a stage computes in, and why: `train.mixed_precision` resolved for this machine from its
capabilities (never from a timing). Imports no torch unless a GPU may be present, so planning a run where
every stage is a store hit stays free of it (stages/training/device.py holds the torch side: autocast).

    auto on a GPU   bf16 where it supports bf16, else fp16 (+ accelerate's gradient scaler)
    auto on a CPU   bf16 where it has bf16 matmul units (CPU_BF16_UNITS), else fp32 ("no")
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.engine.errors import ConfigError

# The CPU's bf16 matmul units, by their /proc/cpuinfo flags (torch.cpu.get_capabilities() spells them the
# same): AMX tiles (Intel Sapphire Rapids and later) and AVX512-BF16 dot products (Intel Cooper Lake, AMD
# Zen 4 and later). oneDNN runs bf16 matmuls on them; without them it converts to fp32 and back, many times
# slower (torch.ops.mkldnn._is_mkldnn_bf16_supported() is true from plain AVX512 on, so it cannot tell).
# Measured on one thread, bf16 autocast vs fp32: AVX512-BF16 without AMX (AMD EPYC, Zen 4) a 1024^2 matmul
# 2.6x faster, a MiniLM training step (8 x 256 tokens, AdamW) 1.6x; with AMX (issue 23's Intel machine) 12x
# and 1.28x. Arm's bf16 extensions are not counted: not measured.
CPU_BF16_UNITS = ("amx_bf16", "avx512_bf16")

# Names the CPU's bf16 units instead of detecting them, comma-separated ("": none). The test suite sets it
# empty, so its numbers do not depend on the machine's CPU. Safe for the cache: the precision a run
# resolves to is in its keys.
UNITS_ENV = "FINETUNE_CPU_BF16_UNITS"

# Device nodes of a GPU driver (NVIDIA, ROCm, WSL): without any, torch cannot see a GPU, and is not imported
GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def cpu_flags() -> set[str]:
    """The CPU's feature flags: /proc/cpuinfo's on Linux, else torch.cpu.get_capabilities()' true ones."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import torch

        return {k for k, v in torch.cpu.get_capabilities().items() if v is True}
    line = next((x for x in text.splitlines() if x.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())


def cpu_bf16_units() -> tuple[str, ...]:
    """The bf16 matmul units this CPU has (empty: none); UNITS_ENV overrides the detection."""
    if (named := os.environ.get(UNITS_ENV)) is not None:
        return tuple(u for u in (x.strip() for x in named.split(",")) if u)
    flags = cpu_flags()
    return tuple(u for u in CPU_BF16_UNITS if u in flags)


def device_type() -> str:
    """"cuda" when torch sees a GPU, else "cpu": where the train stage (and evaluate, predict) compute."""
    if "torch" not in sys.modules and sys.platform == "linux" and not any(os.path.exists(p) for p in GPU_NODES):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Precision:
    """The precision a stage computes in and why: `name` as train.mixed_precision spells it (no: fp32)."""

    name: str  # "no" | "bf16" | "fp16"
    reason: str

    @property
    def dtype(self) -> Any:
        """The autocast dtype (torch.bfloat16 / torch.float16); None for fp32."""
        if self.name == "no":
            return None
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}[self.name]


def auto_precision(device: Any) -> Precision:
    """What `auto` picks on `device` (a torch.device or its type), from its capabilities."""
    if getattr(device, "type", device) == "cuda":
        import torch

        if torch.cuda.is_bf16_supported():
            return Precision("bf16", "the GPU supports bf16")
        return Precision("fp16", "the GPU has no bf16: fp16 with a gradient scaler")
    if units := cpu_bf16_units():
        return Precision("bf16", f"the CPU has bf16 units ({', '.join(units)})")
    return Precision("no", f"the CPU has no bf16 units ({' or '.join(CPU_BF16_UNITS)}): bf16 would be emulated, "
                     "many times slower than fp32")


def resolve_precision(setting: str, device: Any) -> Precision:
    """train.mixed_precision (auto, no, fp16, bf16) on `device` (a torch.device or its type), with the reason:
    what auto picks, or that the setting was given (and what auto would have picked)."""
    auto = auto_precision(device)
    if setting == "auto":
        return Precision(auto.name, f"auto: {auto.reason}")
    if setting == "fp16" and getattr(device, "type", device) != "cuda":
        raise ConfigError("train.mixed_precision: fp16 needs a CUDA GPU; use auto (bf16 on CPUs with bf16 units, "
                          "else fp32) or bf16")
    if setting == auto.name:
        return Precision(setting, f"as auto would choose: {auto.reason}")
    return Precision(setting, f"set (auto would choose {auto.name}: {auto.reason})")


def resolve_mixed_precision(cfg: Any) -> Any:
    """train.mixed_precision `auto` -> what it picks on this machine (bf16, fp16 or no), before any key is
    computed (the train stage's Stage.resolve): the train key, and evaluate's (its forward passes use the same
    precision), hold the precision actually used, so a machine with bf16 units and one without never share
    a train artifact. An explicit setting is kept."""
    if cfg.train.mixed_precision != "auto":
        return cfg
    name = resolve_precision("auto", device_type()).name
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"mixed_precision": name})})


def resolve_compute_dtype(cfg: Any) -> Any:
    """quantization.compute_dtype `auto` on a quantized model -> the dtype it picks on this machine (bfloat16 on
    GPUs that have it, float16 on older ones, float32 on CPU: bitsandbytes' CPU kernels), before any key is
    computed (the model stage's Stage.resolve): the 4/8-bit model a GPU makes and the one a CPU makes never
    share a key. Unquantized models do not use it: their keys keep `auto`."""
    q = cfg.quantization
    if q.mode == "none" or q.compute_dtype != "auto":
        return cfg
    return cfg.model_copy(update={"quantization": q.model_copy(update={"compute_dtype": auto_compute_dtype()})})


def auto_compute_dtype() -> str:
    """What quantization.compute_dtype `auto` loads in here, as the schema spells it."""
    if device_type() != "cuda":
        return "float32"
    import torch

    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
