"""peft workarounds: importing peft without importing bitsandbytes (peft.helpers tries it on import, for a
function this project never calls), and wrapping layers without peft's bitsandbytes probes (which import
it whenever the package is installed, and bitsandbytes then logs its CPU-kernel notices)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from torch import nn

WRITTEN_FOR = "peft>=0.21,<0.22"

BNB_PROBES = ("is_bnb_available", "is_bnb_4bit_available")  # in peft.import_utils and peft.tuners.lora.model


def has_bnb_layers(model: nn.Module) -> bool:
    return any(type(m).__module__.startswith("bitsandbytes") for m in model.modules())


def import_peft(bnb: bool) -> Any:
    """`import peft`; with bnb False and peft not yet imported, without importing bitsandbytes."""
    if bnb or "peft" in sys.modules or "bitsandbytes" in sys.modules:
        import peft

        return peft
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]  # its import raises ImportError
    try:
        import peft
    finally:
        del sys.modules["bitsandbytes"]
        import peft.import_utils as pu

        for name in BNB_PROBES:  # nothing decided while it was hidden
            getattr(getattr(pu, name), "cache_clear", lambda: None)()
    return peft


@contextlib.contextmanager
def peft_dispatch(model: nn.Module) -> Iterator[Any]:
    """Around a PEFT call that wraps `model`'s layers; yields the peft module. For a model without a
    bitsandbytes layer, peft neither imports bitsandbytes nor probes for it, so a pipeline that neither
    quantizes nor uses an 8-bit optimizer never imports bitsandbytes."""
    bnb = has_bnb_layers(model)
    peft = import_peft(bnb)
    if bnb:
        yield peft
        return
    import peft.tuners.lora.model as lora_model

    names = [n for n in BNB_PROBES if hasattr(lora_model, n)]
    saved = {n: getattr(lora_model, n) for n in names}
    for n in names:
        setattr(lora_model, n, lambda: False)
    try:
        yield peft
    finally:
        for n, fn in saved.items():
            setattr(lora_model, n, fn)
