"""What sits at the top of an export folder (export.layout), decided from the config alone: the export stage
writes it, and the plan refuses a layout the folder could not load (stages/graph.py), before any stage runs."""

from __future__ import annotations

from typing import Any

from stages.engine.errors import ConfigError
from stages.models.heads import head_of
from stages.models.hf import split_gguf


def hub_base(m: Any) -> bool:
    """Whether the base is a hub model that from_pretrained(id, revision=sha) rebuilds (not a package, a local
    folder, a GGUF file or a random init)."""
    return not m.from_config and not m.gguf_file and split_gguf(m.name, None)[2] is None


def top_layout(cfg: Any) -> str:
    """`model` (full finetune), `adapter` or `merged`: what sits at the top of the export folder."""
    if cfg.adapters.method == "full":
        return "model"
    m, x = cfg.model, cfg.export
    alone = hub_base(m) and not head_of(cfg).classifies
    if x.layout == "adapter" and not alone:
        why = ("its base is not on a hub" if not hub_base(m) else
               "a classifier's head is new (its size and labels are this run's), so the hub base cannot rebuild it")
        raise ConfigError(f"export.layout adapter: the adapter alone cannot load from the export folder ({why}); "
                          f"set export.layout to auto or merged")
    if x.layout == "auto":  # e.g. the ONNX export and llama.cpp's converter read merged weights
        from stages.formats import FORMATS  # (this package's registry: its modules import this one)

        beside = any(FORMATS[f].from_merged for f in x.formats)
        return "adapter" if alone and cfg.quantization.mode == "none" and not beside else "merged"
    return x.layout
