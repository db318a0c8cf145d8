"""transformers workarounds: the class attributes that keep modules in fp32 (`_keep_in_fp32_modules*`),
its quantizer helpers that decide which modules bitsandbytes converts, the quantizer marker a GGUF load
leaves on a model, and the quantization config a dequantized model keeps."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

WRITTEN_FOR = "transformers>=5.24,<5.25"

KEEP_FP32_ATTRS = ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")


def keep_in_fp32_modules(model: nn.Module) -> tuple[set[str], set[str]]:
    """The model class's (keep, strict) fp32 modules. transformers 5 upcasts `keep` only when loading in
    fp16, the strict ones in fp16 and bf16."""
    keep, strict = (set(getattr(model, a, None) or ()) for a in KEEP_FP32_ATTRS)
    return keep, strict


@contextlib.contextmanager
def fp32_modules_quantized(cls: type, enabled: bool) -> Iterator[None]:
    """Let bitsandbytes quantize the modules the class keeps in fp32 (T5's `wo`)."""
    if not enabled:
        yield
        return
    # patched where it is defined (T5PreTrainedModel), so sub-models such as T5Stack see it too
    saved = [(c, a, c.__dict__[a]) for c in cls.__mro__ for a in KEEP_FP32_ATTRS if a in c.__dict__]
    for c, a, _ in saved:
        setattr(c, a, None)
    try:
        yield
    finally:
        for c, a, v in saved:
            setattr(c, a, v)


def keys_to_not_convert(model: nn.Module) -> set[str]:
    """The modules transformers' bitsandbytes quantizer leaves unquantized (tied embeddings, the output head)."""
    from transformers.quantizers.base import get_keys_to_not_convert

    return set(get_keys_to_not_convert(model))


def matches_modules(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether `name` is one of the modules `patterns` names, matched as the quantizer matches them."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    return bool(patterns) and not should_convert_module(name, list(patterns))


def clear_gguf_quantizer(model: Any) -> None:
    """A GGUF load leaves a quantizer that refuses save_pretrained; the weights are plain fp32 tensors."""
    model.hf_quantizer = None
    drop_quantization_config(model)
    for attr in ("quantization_method", "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.__dict__.pop(attr, None)


def drop_quantization_config(model: Any) -> None:
    """A dequantized (or merged) model's config without the `quantization_config` its load left: PretrainedConfig
    has no API to unset it, and save_pretrained would write it into config.json (a reload would quantize)."""
    model.config.__dict__.pop("quantization_config", None)
