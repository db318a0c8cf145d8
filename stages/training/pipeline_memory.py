"""Will a pipeline's training fit? The memory estimate of a whole pipeline from its config alone (the model
built on the meta device, no weights read), and the precheck that stops a run that cannot fit."""

from __future__ import annotations

from stages.engine.units import human_bytes
from stages.models import memory
from stages.models.heads import head_of
from stages.models.model_loading import compute_dtype, hf_config, meta_and_plan
from stages.pipeline.schema import PipelineConfig


def estimate_pipeline(cfg: PipelineConfig) -> memory.Estimate:
    """The whole training estimate for a PipelineConfig: weights, adapters, gradients, optimizer state and
    activations for train.micro_batch_size x tokenize.max_length. Loads no weights."""
    head = head_of(cfg)
    config = hf_config(cfg.model, head)
    meta, plan = meta_and_plan(cfg.model, cfg.quantization, config, head)
    est = memory.adapters_estimate(memory.weights_estimate(meta, plan), meta, plan, cfg.adapters)
    est.gradients = 4 * est.trainable_params
    est.optimizer = memory.OPTIMIZER_STATE_BYTES[cfg.train.optimizer] * est.trainable_params
    compute = compute_dtype(cfg.quantization.compute_dtype)
    t = cfg.tokenize
    est.activations = memory.activation_bytes(config, cfg.train.micro_batch_size, t.max_length,
                                       t.max_target_length if head.encoder_decoder else None,
                                       memory.DTYPE_BYTES[compute], cfg.train.gradient_checkpointing)
    return est


def check_pipeline_fits(cfg: PipelineConfig) -> memory.Estimate | None:
    """Estimate a pipeline's training memory and stop (ConfigError naming the knobs) if it cannot fit.
    Nothing is estimated with model.memory_check=false (None)."""
    if not cfg.model.memory_check:
        return None
    est = estimate_pipeline(cfg)
    memory.check_fits(est.total, f"pipeline {cfg.name}")
    return est


def format_estimate(est: memory.Estimate) -> str:
    rows = [("weights (get_memory_footprint)", est.weights), ("quantization constants", est.quant_constants),
            ("adapters / trainable copies", est.adapters), ("gradients (fp32)", est.gradients),
            ("optimizer states", est.optimizer), ("activations (rough)", est.activations), ("total", est.total)]
    lines = [f"  {k:<32} {v:>16,} B  {human_bytes(v):>12}" for k, v in rows]
    pct = 100 * est.trainable_params / max(est.total_params, 1)
    lines.append(f"  parameters {est.total_params:,} (quantized {est.quantized_params:,}, fp32-kept "
                 f"{est.fp32_kept_params:,}), trainable {est.trainable_params:,} ({pct:.2f}%)")
    return "\n".join(lines)
