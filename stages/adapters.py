"""Adapters stage: what will be trained. `lora` attaches PEFT LoRA adapters (with
`prepare_model_for_kbit_training` when the model is quantized) and saves the initial adapter
(`adapter/`, seeded by adapters.init_seed); `full` makes every parameter trainable (the BLOOM article)
and saves only `adapters.json`. Manifest: trainable / total / percent.

`stages.models.model_loading.load_trainable` reads this artifact for the train stage: the model ready to train.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from stages.engine.errors import ConfigError
from stages.engine.stage import StageContext
from stages.models import memory
from stages.models.compat.peft import peft_dispatch
from stages.models.heads import head_named
from stages.models.model_loading import ADAPTERS_INFO, count_parameters, load_info, load_model, save_adapter
from stages.pipeline.schema import AdaptersConfig


def linear_names(model: nn.Module) -> list[str]:
    """The short names of the model's Linear-like modules (what target_modules may name)."""
    from transformers.pytorch_utils import Conv1D

    return sorted({n.rsplit(".", 1)[-1] for n, mod in model.named_modules()
                   if n and isinstance(mod, nn.Linear | Conv1D)})


def check_targets(model: nn.Module, target_modules: list[str], modules_to_save: list[str]) -> None:
    """Every problem at once: unknown target modules (listing the linear names) and unknown modules_to_save."""
    problems = []
    unknown = [t for t in target_modules if not memory.lora_target_modules(model, [t])]
    if unknown:
        problems.append(f"adapters.target_modules {unknown} match no module of {type(model).__name__}; its linear "
                        f"modules are {linear_names(model)}")
    unsaved = [t for t in modules_to_save if not memory.lora_target_modules(model, [t])]
    if unsaved:
        heads = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_children()})
        problems.append(f"adapters.modules_to_save {unsaved} match no module; top-level modules are {heads}, "
                        f"linear modules {linear_names(model)}")
    if problems:
        raise ConfigError("; ".join(problems))


def lora_config(a: AdaptersConfig, head: str) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=a.r, lora_alpha=a.alpha,
                      lora_dropout=a.dropout, target_modules=list(a.target_modules),
                      modules_to_save=list(a.modules_to_save) or None, bias=a.bias, task_type=head_named(head).peft_task_type)


def lora_module_names(model: nn.Module) -> list[str]:
    """Full names of the modules that carry LoRA weights (without the PEFT wrapper prefix)."""
    names = [n for n, mod in model.named_modules() if hasattr(mod, "lora_A") and len(getattr(mod, "lora_A", {}))]
    return [n.removeprefix("base_model.model.") for n in names]


def run(ctx: StageContext) -> dict[str, Any]:
    a = ctx.cfg.adapters
    model_dir = ctx.upstream["model"]
    info = load_info(model_dir)
    quantized = info["quantization"] != "none"
    if a.method == "full":
        if quantized:
            raise ConfigError(f"adapters.method full: the model is quantized ({info['quantization']}) and "
                              f"quantized weights cannot be trained; use adapters.method=lora or quantization.mode=none")
        # the model stage's manifest has the count; loading the whole model only for it is a waste
        total = ctx.upstream_manifests.get("model", {}).get("metrics", {}).get("parameters")
        if total is None:  # an artifact from before the model stage recorded it
            total = count_parameters(load_model(model_dir))[1]
        facts = {"method": "full", "trainable": total, "total": total, "percent": 100.0}
        (ctx.out_dir / ADAPTERS_INFO).write_text(json.dumps(facts, indent=2, sort_keys=True))
        return facts

    model = load_model(model_dir)
    check_targets(model, list(a.target_modules), list(a.modules_to_save))
    with peft_dispatch(model) as peft:
        if quantized:
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        torch.manual_seed(a.init_seed)
        peft_model = peft.get_peft_model(model, lora_config(a, info["head"]))
    save_adapter(peft_model, ctx.out_dir / "adapter")
    trainable, total = count_parameters(peft_model)
    wrapped = lora_module_names(peft_model)
    facts = {"method": "lora", "trainable": trainable, "total": total, "percent": round(100 * trainable / total, 4),
             "lora_modules": len(wrapped), "lora_targets": sorted({n.rsplit(".", 1)[-1] for n in wrapped}),
             "modules_to_save": sorted(peft_model.modules_to_save or []),
             "footprint_bytes": int(peft_model.get_memory_footprint())}
    (ctx.out_dir / ADAPTERS_INFO).write_text(json.dumps({"method": "lora", "head": info["head"]}, indent=2, sort_keys=True))
    ctx.log.info("adapters: lora on %d modules (%s), trainable %s of %s (%.2f%%)", len(wrapped),
                 ", ".join(facts["lora_targets"]), f"{trainable:,}", f"{total:,}", facts["percent"])
    return facts

