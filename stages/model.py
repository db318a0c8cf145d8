"""Model stage: load (hub id with revision, local folder, GGUF file, or a random model from a config),
quantize with bitsandbytes, and save the result as the artifact, so later runs neither download,
dequantize GGUF nor re-quantize.

Artifact: `model/` = save_pretrained output (safetensors; bitsandbytes-serialised with
quantization_config in config.json when quantized) plus `model/finetune.json` (head, class, dtypes),
which `load_model` reads. Manifest: footprint, parameters by dtype, layers by type, the estimate made
before loading beside the measured footprint, load time, peak RSS.

Newly initialised heads (`score`, `classifier`) and `lm_head` are never quantized; modules the model
keeps in fp32 (T5's `wo`) stay fp32 unless `quantization.quantize_fp32_modules`.
"""
from __future__ import annotations

import json
import resource
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stages.engine.stage import StageContext
from stages.engine.units import human_bytes
from stages.models import memory
from stages.models.compat.bitsandbytes import quant_state_bytes
from stages.models.compat.transformers import clear_gguf_quantizer, fp32_modules_quantized
from stages.models.heads import head_of
from stages.models.hf import load_tokenizer, pretrained_source
from stages.models.model_loading import (
    LOAD_INFO,
    auto_class,
    bnb_config,
    compute_dtype,
    count_parameters,
    hf_config,
    meta_and_plan,
    quiet_transformers,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# ---------------------------------------------------------------- measuring


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # Linux: KiB


def describe(model: PreTrainedModel) -> dict[str, Any]:
    """Footprint, parameters by dtype, layers by type (the Linear family) of a loaded model."""
    by_dtype: Counter[str] = Counter()
    for p in model.parameters():
        by_dtype[str(p.dtype).removeprefix("torch.")] += p.numel()
    layers = Counter(type(mod).__name__ for mod in model.modules() if isinstance(mod, nn.Linear))
    return {
        "footprint_bytes": int(model.get_memory_footprint()),
        "quant_state_bytes": quant_state_bytes(model),
        "parameters_by_dtype": dict(sorted(by_dtype.items())),
        "layers_by_type": {k: layers.get(k, 0) for k in ("Linear4bit", "Linear8bitLt", "Linear")} | dict(layers),
    }


# ---------------------------------------------------------------- the stage

def _set_pad_token(ctx: StageContext, config: Any) -> int | None:
    if not head_of(ctx.cfg).classifies or getattr(config, "pad_token_id", None) is not None:
        return getattr(config, "pad_token_id", None)
    try:
        pad = load_tokenizer(ctx.cfg).pad_token_id
    except Exception as e:  # a from_config model without a loadable tokenizer
        ctx.log.warning("model: no tokenizer to take a pad token id from (%s); using 0", e)
        pad = 0
    config.pad_token_id = pad
    return pad


def run(ctx: StageContext) -> dict[str, Any]:
    quiet_transformers()
    m, q = ctx.cfg.model, ctx.cfg.quantization
    head = head_of(ctx.cfg)
    config = hf_config(m, head)
    names = ctx.cfg.data.label_names if head.classifies else None
    if names:  # the classes by name in the model's config, and so in every model exported from it
        config.id2label = dict(enumerate(names))
        config.label2id = {n: i for i, n in enumerate(names)}
    pad = _set_pad_token(ctx, config)
    meta, plan = meta_and_plan(m, q, config, head)
    cls = type(meta)
    est = memory.weights_estimate(meta, plan)
    del meta
    ctx.log.info("model: %s estimated %s weights + %s quantization constants before loading", m.name,
                 human_bytes(est.weights), human_bytes(est.quant_constants))
    if m.memory_check:
        memory.check_fits(est.weights + est.quant_constants, f"model {m.name} ({q.mode})")

    qconfig = bnb_config(q, plan)
    t0 = time.perf_counter()
    torch.manual_seed(m.init_seed)  # random models and new heads are reproducible
    source, kwargs, local = (None, {}, None) if m.from_config else pretrained_source(m.name, m.gguf_file, "model")
    common = {"config": config, "trust_remote_code": m.trust_remote_code}
    if m.from_config or "gguf_file" in kwargs:
        # build / dequantize in fp32 once, then (re)load from that plain checkpoint to quantize or cast
        if m.from_config:
            model = auto_class(head).from_config(config, dtype=torch.float32, trust_remote_code=m.trust_remote_code)
        else:  # a GGUF in a hub repo, or one the cache could not take
            model = cls.from_pretrained(source, revision=m.revision if local is None else None,
                                        dtype=torch.float32, **kwargs, **common)
            clear_gguf_quantizer(model)
        if qconfig is not None or plan.dtype != torch.float32:
            base = ctx.work_dir / "base"
            model.save_pretrained(base)
            del model
            with fp32_modules_quantized(cls, q.quantize_fp32_modules):
                model = cls.from_pretrained(base, dtype=plan.dtype, quantization_config=qconfig, use_safetensors=True,
                                            **common)
    else:  # safetensors only: never a pickle's torch.load (a local folder's files were checked at plan time)
        with fp32_modules_quantized(cls, q.quantize_fp32_modules):
            model = cls.from_pretrained(source, revision=m.revision if local is None else None,
                                        dtype=plan.dtype, use_safetensors=True,
                                        quantization_config=qconfig, **kwargs, **common)
    load_s = time.perf_counter() - t0

    out = ctx.out_dir / "model"
    model.save_pretrained(out)
    info = {"head": head.name, "model_class": cls.__name__, "trust_remote_code": m.trust_remote_code,
            "quantization": q.mode,
            "quantize_fp32_modules": q.quantize_fp32_modules, "dtype": str(plan.dtype).removeprefix("torch."),
            "compute_dtype": str(compute_dtype(q.compute_dtype)).removeprefix("torch.")}
    (out / LOAD_INFO).write_text(json.dumps(info, indent=2))

    facts = describe(model)
    measured = facts["footprint_bytes"]
    ctx.log.info("model: footprint estimated %s, measured %s (%+.1f%%); layers %s", human_bytes(est.weights),
                 human_bytes(measured), 100 * (est.weights / measured - 1), facts["layers_by_type"])
    return {
        **info, **facts,
        "pad_token_id": pad,
        "parameters": count_parameters(model)[1],
        "estimate": {"footprint_bytes": est.weights, "quant_constants_bytes": est.quant_constants,
                     "quantized_params": est.quantized_params, "fp32_kept_params": est.fp32_kept_params,
                     "vs_measured": round(est.weights / measured, 4)},
        "load_s": round(load_s, 2),
        "peak_rss_mb": peak_rss_mb(),
    }
