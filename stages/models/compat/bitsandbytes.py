"""bitsandbytes internals read to measure a quantized model: the quantization constants that
get_memory_footprint does not count (4-bit `QuantState`, 8-bit `SCB`), which are not parameters, and the
number of weights a packed 4-bit parameter holds; the flag that keeps 4-bit layers on a CPU on their exact
fp32 path."""

from __future__ import annotations

import math

from torch import nn

WRITTEN_FOR = "bitsandbytes>=0.50,<0.51"


def quant_state_bytes(model: nn.Module) -> int:
    """bitsandbytes' scales in a loaded model, in bytes."""
    total = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        qs = getattr(w, "quant_state", None)
        if qs is not None:
            total += qs.absmax.numel() * qs.absmax.element_size()
            if getattr(qs, "state2", None) is not None:
                s2 = qs.state2
                total += s2.absmax.numel() * s2.absmax.element_size() + s2.code.numel() * s2.code.element_size()
                total += qs.offset.numel() * qs.offset.element_size() if qs.offset is not None else 0
        scb = getattr(w, "SCB", None)
        if scb is not None and not any(scb is b for b in mod.buffers()):
            total += scb.numel() * scb.element_size()
    return total


def held_weights(p: nn.Parameter) -> int:
    """How many weights a parameter holds. A quantized `Params4bit` stores two 4-bit values per uint8 element
    (its `numel()` is half the count, or less with a wider `quant_storage`); its `QuantState` keeps the
    shape of the weight it packs. Any other parameter (a `Params4bit` not yet quantized included) is its numel."""
    qs = getattr(p, "quant_state", None) if type(p).__name__ == "Params4bit" else None
    return math.prod(qs.shape) if qs is not None and getattr(qs, "shape", None) is not None else p.numel()


def exact_cpu_kernels(model: nn.Module) -> None:
    """bitsandbytes 4-bit layers on a CPU with AVX512-BF16 repack their weights at the first no-grad forward
    and then compute in bf16 (2-3 significant digits). Keep them on the fp32 dequantize-and-matmul path,
    the one training used: the metrics are then those of the fp32 model the export stage merges."""
    for mod in model.modules():
        if getattr(mod, CPU_BF16_FLAG, False):
            setattr(mod, CPU_BF16_FLAG, False)  # not an attribute nn.Module declares


CPU_BF16_FLAG = "support_avx512bf16_for_cpu"  # set by Linear4bit where the CPU has AVX512-BF16
