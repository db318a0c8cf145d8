"""Memory accounting: estimate a model's footprint from its config alone, before any weight is loaded,
and measure what a loaded model really holds.

The estimate walks the model built on the `meta` device (shapes and dtypes, no storage) and prices
every parameter the way bitsandbytes and PEFT will store it:

  weights          what `get_memory_footprint()` will report: quantized Linear weights at 4 or 8 bits,
                   modules kept in fp32 (T5's `wo` when loading in fp16: transformers 5 keeps them in
                   the load dtype for bf16), everything else in the load dtype, plus buffers
  quant_constants  bitsandbytes' per-block scales (absmax, double-quant second level; 8-bit row scales),
                   which live in the layers' quant_state and which `get_memory_footprint()` does not count
  adapters         LoRA A/B in fp32, modules_to_save copies, and the fp32 upcast that
                   `prepare_model_for_kbit_training` applies to 16-bit params of a quantized model
  gradients        fp32, one per trainable parameter
  optimizer        Adam: 8 bytes per trainable parameter; 8-bit Adam: 2
  activations      a rough term for the micro-batch and sequence length (see `activation_bytes`)

`python -m flows.inspect memory PIPELINE [--set k=v ...]` prints the estimate for a pipeline without loading it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stages.engine.errors import ConfigError
from stages.engine.units import human_bytes
from stages.models.compat.transformers import matches_modules
from stages.pipeline.schema import AdaptersConfig

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.int8: 1, torch.uint8: 1}
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw_torch": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2}
BNB_BLOCKSIZE = 64  # bitsandbytes 4-bit block size (one absmax per block)
DOUBLE_QUANT_BLOCKSIZE = 256  # second-level blocks of the quantized absmax
FIT_KNOBS = ("quantization.mode=4bit (with adapters.method=lora)",
             "a smaller train.micro_batch_size with more train.gradient_accumulation_steps",
             "train.gradient_checkpointing=true", "train.optimizer=paged_adamw_8bit", "a shorter tokenize.max_length")


@dataclass(frozen=True)
class QuantPlan:
    """How the model stage will store each weight."""

    mode: str = "none"  # none | 8bit | 4bit
    double_quant: bool = False
    dtype: torch.dtype = torch.float32  # dtype of everything not quantized
    skip: tuple[str, ...] = ()  # never quantized (heads, tied embeddings, user skip_modules)
    keep: tuple[str, ...] = ()  # the model's _keep_in_fp32_modules: bitsandbytes leaves them unquantized
    keep_fp32: tuple[str, ...] = ()  # modules stored in fp32 whatever the dtype (transformers 5: `keep` only
    # when loading in fp16, `_keep_in_fp32_modules_strict` in fp16 and bf16)


@dataclass
class Estimate:
    weights: int = 0
    quant_constants: int = 0
    adapters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    total_params: int = 0
    trainable_params: int = 0
    quantized_params: int = 0
    fp32_kept_params: int = 0

    @property
    def footprint(self) -> int:
        """Comparable to get_memory_footprint() of the loaded model."""
        return self.weights

    @property
    def training_footprint(self) -> int:
        """Comparable to get_memory_footprint() after adapters are attached (or full training's params)."""
        return self.weights + self.adapters

    @property
    def total(self) -> int:
        return (self.weights + self.quant_constants + self.adapters + self.gradients + self.optimizer
                + self.activations)


def weights_estimate(meta: nn.Module, plan: QuantPlan) -> Estimate:
    """Price every parameter (and buffer) of a meta-device model as the loader will store it."""
    est = Estimate()
    pbytes = DTYPE_BYTES[plan.dtype]
    priced: set[int] = set()
    for name, module in meta.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in priced]
        if not own:
            continue
        is_linear = type(module) is nn.Linear
        kept = matches_modules(name, plan.keep_fp32)
        quantize = (plan.mode != "none" and is_linear and not matches_modules(name, plan.skip)
                    and not matches_modules(name, plan.keep))
        for pname, p in own:
            priced.add(id(p))
            n = p.numel()
            est.total_params += n
            if quantize and pname == "weight":
                est.quantized_params += n
                if plan.mode == "4bit":
                    est.weights += (n + 1) // 2  # two 4-bit codes per uint8
                    blocks = math.ceil(n / BNB_BLOCKSIZE)
                    if plan.double_quant:  # uint8 absmax + fp32 second-level absmax, 256-entry code, offset
                        est.quant_constants += blocks + 4 * math.ceil(blocks / DOUBLE_QUANT_BLOCKSIZE) + 4 * 257
                    else:
                        est.quant_constants += 4 * blocks
                else:  # int8 weight + one fp32 scale per output row
                    est.weights += n
                    est.quant_constants += 4 * p.shape[0]
            elif kept:
                est.fp32_kept_params += n
                est.weights += 4 * n
            else:
                est.weights += pbytes * n
    est.weights += sum(b.numel() * b.element_size() for b in meta.buffers())
    return est


def lora_target_modules(model: nn.Module, targets: list[str]) -> list[str]:
    """Full names of the modules PEFT will wrap for these target names (exact or `.suffix` match)."""
    return [n for n, _ in model.named_modules() if n and any(n == t or n.endswith("." + t) for t in targets)]


def adapters_estimate(est: Estimate, meta: nn.Module, plan: QuantPlan, adapters: AdaptersConfig) -> Estimate:
    """Add LoRA weights / modules_to_save copies (or full training) and the trainable count."""
    if adapters.method == "full":
        est.trainable_params = est.total_params
        return est
    lora = 0
    for name in lora_target_modules(meta, list(adapters.target_modules)):
        mod = meta.get_submodule(name)
        if isinstance(mod, nn.Linear):
            lora += adapters.r * (mod.in_features + mod.out_features)
    saved = sum(p.numel() for n in lora_target_modules(meta, list(adapters.modules_to_save))
                for p in meta.get_submodule(n).parameters())
    biases = 0
    if adapters.bias == "all":
        biases = sum(p.numel() for n, p in meta.named_parameters() if n.endswith(".bias"))
    elif adapters.bias == "lora_only":
        biases = sum(b.numel() for n in lora_target_modules(meta, adapters.target_modules)
                     if (b := getattr(meta.get_submodule(n), "bias", None)) is not None)
    # prepare_model_for_kbit_training casts every 16-bit parameter of a quantized model to fp32
    upcast = 0
    if plan.mode != "none" and plan.dtype != torch.float32:
        upcast = (est.total_params - est.quantized_params - est.fp32_kept_params) * (4 - DTYPE_BYTES[plan.dtype])
    copy_bytes = 4 if plan.mode != "none" else DTYPE_BYTES[plan.dtype]
    est.adapters = 4 * lora + copy_bytes * saved + upcast
    est.trainable_params = lora + saved + biases
    est.total_params += lora + saved
    return est


def activation_bytes(config: Any, micro_batch: int, length: int, target_length: int | None, compute_bytes: int,
                     checkpointing: bool) -> int:
    """A rough activation term: about 16 hidden-sized values per token and layer kept for backward
    (attention scores, heads x length per token, on top), one layer's worth plus layer inputs with
    gradient checkpointing; fp32 logits and their gradient. Good to a factor of two, no better."""
    h: int = getattr(config, "hidden_size", 0) or getattr(config, "d_model", 0)
    layers: int = getattr(config, "num_hidden_layers", 0) or getattr(config, "num_layers", 1)
    layers += getattr(config, "num_decoder_layers", 0) or 0
    heads: int = getattr(config, "num_attention_heads", 0) or getattr(config, "num_heads", 1)
    vocab = getattr(config, "vocab_size", 0)
    s = length + (target_length or 0)
    per_layer = micro_batch * s * (16 * h + 2 * heads * s) * compute_bytes
    kept = micro_batch * s * h * compute_bytes * layers + per_layer if checkpointing else per_layer * layers
    logits = 2 * 4 * micro_batch * (target_length or length) * vocab
    return int(kept + logits)


def free_memory() -> tuple[int, str]:
    """(bytes free on the device the model will use, its name)."""
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return int(free), f"GPU {torch.cuda.get_device_name()}"
    import psutil

    return int(psutil.virtual_memory().available), "CPU RAM"


def check_fits(need: int, what: str, free: int | None = None, device: str | None = None) -> None:
    """Raise ConfigError, naming the knobs, when `need` bytes exceed the device's free memory."""
    if free is None:
        free, device = free_memory()
    if need > free:
        raise ConfigError(f"{what}: estimated {human_bytes(need)} but {device or 'the device'} has {human_bytes(free)} free; "
                          f"stopping before loading. Lower it with {'; '.join(FIT_KNOBS)}")

