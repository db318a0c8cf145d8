"""Model stage: load (hub id with revision, local folder, GGUF file, or a random model from a config),
quantize with bitsandbytes, and save the result as the artifact, so later runs neither download,
dequantize GGUF nor re-quantize.

Artifact: `model/` = save_pretrained output (safetensors; bitsandbytes-serialised with
quantization_config in config.json when quantized) plus `model/finetune.json` (task, class, dtypes),
which `load_model` reads. Manifest: footprint, parameters by dtype, layers by type, the estimate made
before loading beside the measured footprint, load time, peak RSS.

Newly initialised heads (`score`, `classifier`) and `lm_head` are never quantized; modules the model
keeps in fp32 (T5's `wo`) stay fp32 unless `quantization.quantize_fp32_modules`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import resource
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stages import memory
from stages.errors import ConfigError
from stages.hf import HUB_FIX, split_gguf, tokenizer_files
from stages.hub import ensure_hub_reachable

AUTO_CLASSES = {"seq_cls": "AutoModelForSequenceClassification", "seq2seq": "AutoModelForSeq2SeqLM",
                "causal_lm": "AutoModelForCausalLM"}
HEAD_MODULES = ("score", "classifier", "lm_head")  # never quantized
LOAD_INFO = "finetune.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------- config -> what to build


def auto_class(task: str) -> Any:
    import transformers

    return getattr(transformers, AUTO_CLASSES[task])


def compute_dtype(name: str) -> torch.dtype:
    """`auto`: bf16 on GPUs that have it, fp16 on older GPUs, fp32 on CPU (bf16 matmul is ~80x slower there)."""
    if name != "auto":
        return DTYPES[name]
    if torch.cuda.is_available():
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def param_dtype(m: Any, q: Any) -> torch.dtype:
    """dtype of the parameters that are not quantized. `auto`: fp32 unquantized (mixed precision keeps fp32
    master weights); the compute dtype when quantized (what the QLoRA recipe loads)."""
    if m.dtype != "auto":
        return DTYPES[m.dtype]
    return compute_dtype(q.compute_dtype) if q.mode != "none" else torch.float32


def hf_config(m: Any) -> Any:
    """The transformers config, from model.from_config, a GGUF header, a local folder or the hub."""
    from transformers import AutoConfig

    if m.from_config:
        spec = dict(m.from_config)
        model_type = spec.pop("model_type", None)
        if not model_type:
            raise ConfigError("model.from_config: needs model_type (e.g. bloom, t5, llama)")
        try:
            config = AutoConfig.for_model(model_type, **spec)
        except ValueError as e:
            raise ConfigError(f"model.from_config: {e}") from None
    else:
        source, kwargs, local = split_gguf(m.name, m.gguf_file)
        if local is None:
            ensure_hub_reachable(f"model {m.name}", HUB_FIX, m.name, m.revision)
        if "gguf_file" in kwargs and local is not None and local.is_file():
            st = local.stat()  # parsing a GGUF header takes seconds: once per file version and process
            config = copy.deepcopy(_gguf_config(str(local), st.st_size, st.st_mtime_ns))
        else:
            config = AutoConfig.from_pretrained(source, revision=m.revision if local is None else None,
                                                trust_remote_code=m.trust_remote_code, **kwargs)
    if m.task == "seq_cls":
        config.num_labels = m.num_labels or 2
    return config


@functools.lru_cache(maxsize=4)
def _gguf_config(path: str, size: int, mtime_ns: int) -> Any:
    from transformers import AutoConfig

    p = Path(path)
    return AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)


def meta_model(m: Any, config: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model's modules on the meta device: shapes and dtypes, no storage, no weights read."""
    with torch.device("meta"):
        return auto_class(m.task).from_config(config, dtype=dtype, trust_remote_code=m.trust_remote_code)


def meta_and_plan(m: Any, q: Any, config: Any) -> tuple[nn.Module, memory.QuantPlan]:
    from transformers.quantizers.base import get_keys_to_not_convert

    dtype = param_dtype(m, q)
    meta = meta_model(m, config, dtype)
    keep = set() if q.quantize_fp32_modules else set(getattr(meta, "_keep_in_fp32_modules", None) or ())
    strict = set() if q.quantize_fp32_modules else set(getattr(meta, "_keep_in_fp32_modules_strict", None) or ())
    # transformers 5 upcasts `_keep_in_fp32_modules` only when loading in fp16, the strict ones in fp16 and bf16
    fp32 = (keep if dtype == torch.float16 else set()) | (strict if dtype != torch.float32 else set())
    skip = set(get_keys_to_not_convert(meta)) | set(HEAD_MODULES) | set(q.skip_modules)
    return meta, memory.QuantPlan(q.mode, q.double_quant, dtype, tuple(sorted(skip)), tuple(sorted(keep)),
                                  tuple(sorted(fp32)))


def bnb_config(q: Any, plan: memory.QuantPlan) -> Any:
    from transformers import BitsAndBytesConfig

    if q.mode == "none":
        return None
    if q.mode == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=list(plan.skip))
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.quant_type,
                              bnb_4bit_use_double_quant=q.double_quant,
                              bnb_4bit_compute_dtype=compute_dtype(q.compute_dtype),
                              llm_int8_skip_modules=list(plan.skip))


@contextlib.contextmanager
def fp32_modules_quantized(cls: type, enabled: bool) -> Iterator[None]:
    """Let bitsandbytes quantize the modules the class keeps in fp32 (T5's `wo`)."""
    if not enabled:
        yield
        return
    # patched where it is defined (T5PreTrainedModel), so sub-models such as T5Stack see it too
    saved = [(c, a, c.__dict__[a]) for c in cls.__mro__ for a in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")
             if a in c.__dict__]
    for c, a, _ in saved:
        setattr(c, a, None)
    try:
        yield
    finally:
        for c, a, v in saved:
            setattr(c, a, v)


def model_files(cfg: Any) -> list[Path]:
    """Local checkpoint files whose content is in the key (a hub model is identified by id + revision)."""
    m = cfg.model
    if m.from_config:
        return []
    _, _, local = split_gguf(m.name, m.gguf_file)
    if local is None:
        return []
    if local.is_file():
        return [local]
    return sorted(p for p in local.iterdir() if p.is_file() and (
        p.suffix in (".safetensors", ".json", ".bin", ".gguf") and not p.name.startswith("tokenizer")))


def input_files(cfg: Any) -> list[Path]:
    """The stage's input files: the local checkpoint, and the tokenizer a pad token id may come from."""
    return sorted(set(model_files(cfg)) | set(tokenizer_files(cfg)))


# ---------------------------------------------------------------- measuring


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # Linux: KiB


def quant_state_bytes(model: nn.Module) -> int:
    """bitsandbytes' scales, which get_memory_footprint does not count (they are not parameters)."""
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


def describe(model: nn.Module) -> dict[str, Any]:
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


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _clear_gguf_marker(model: Any) -> None:
    """A GGUF load leaves a quantizer that refuses save_pretrained; the weights are plain fp32 tensors."""
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    for attr in ("quantization_method", "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.__dict__.pop(attr, None)


def _set_pad_token(ctx: Any, config: Any) -> int | None:
    if ctx.cfg.model.task != "seq_cls" or getattr(config, "pad_token_id", None) is not None:
        return getattr(config, "pad_token_id", None)
    from stages.hf import load_tokenizer

    try:
        pad = load_tokenizer(ctx.cfg).pad_token_id
    except Exception as e:  # a from_config model without a loadable tokenizer
        ctx.log.warning("model: no tokenizer to take a pad token id from (%s); using 0", e)
        pad = 0
    config.pad_token_id = pad
    return pad


def run(ctx: Any) -> dict[str, Any]:
    _quiet()
    m, q = ctx.cfg.model, ctx.cfg.quantization
    config = hf_config(m)
    pad = _set_pad_token(ctx, config)
    meta, plan = meta_and_plan(m, q, config)
    cls = type(meta)
    est = memory.weights_estimate(meta, plan)
    del meta
    ctx.log.info("model: %s estimated %s weights + %s quantization constants before loading", m.name,
                 memory.human(est.weights), memory.human(est.quant_constants))
    if m.memory_check:
        memory.check_fits(est.weights + est.quant_constants, f"model {m.name} ({q.mode})")

    qconfig = bnb_config(q, plan)
    t0 = time.perf_counter()
    torch.manual_seed(m.init_seed)  # random models and new heads are reproducible
    source, kwargs, local = (None, {}, None) if m.from_config else split_gguf(m.name, m.gguf_file)
    common = {"config": config, "trust_remote_code": m.trust_remote_code}
    if m.from_config or "gguf_file" in kwargs:
        # build / dequantize in fp32 once, then (re)load from that plain checkpoint to quantize or cast
        if m.from_config:
            model = auto_class(m.task).from_config(config, dtype=torch.float32, trust_remote_code=m.trust_remote_code)
        else:
            model = cls.from_pretrained(source, revision=m.revision if local is None else None, dtype=torch.float32,
                                        **kwargs, **common)
            _clear_gguf_marker(model)
        if qconfig is not None or plan.dtype != torch.float32:
            base = ctx.work_dir / "base"
            model.save_pretrained(base)
            del model
            with fp32_modules_quantized(cls, q.quantize_fp32_modules):
                model = cls.from_pretrained(base, dtype=plan.dtype, quantization_config=qconfig, **common)
    else:
        with fp32_modules_quantized(cls, q.quantize_fp32_modules):
            model = cls.from_pretrained(source, revision=m.revision if local is None else None, dtype=plan.dtype,
                                        quantization_config=qconfig, **kwargs, **common)
    load_s = time.perf_counter() - t0

    out = ctx.out_dir / "model"
    model.save_pretrained(out)
    info = {"task": m.task, "model_class": cls.__name__, "trust_remote_code": m.trust_remote_code,
            "quantization": q.mode,
            "quantize_fp32_modules": q.quantize_fp32_modules, "dtype": str(plan.dtype).removeprefix("torch."),
            "compute_dtype": str(compute_dtype(q.compute_dtype)).removeprefix("torch.")}
    (out / LOAD_INFO).write_text(json.dumps(info, indent=2))

    facts = describe(model)
    measured = facts["footprint_bytes"]
    ctx.log.info("model: footprint estimated %s, measured %s (%+.1f%%); layers %s", memory.human(est.weights),
                 memory.human(measured), 100 * (est.weights / measured - 1), facts["layers_by_type"])
    return {
        **info, **facts,
        "pad_token_id": pad,
        "parameters": sum(p.numel() for p in model.parameters()),
        "estimate": {"footprint_bytes": est.weights, "quant_constants_bytes": est.quant_constants,
                     "quantized_params": est.quantized_params, "fp32_kept_params": est.fp32_kept_params,
                     "vs_measured": round(est.weights / measured, 4)},
        "load_s": round(load_s, 2),
        "peak_rss_mb": peak_rss_mb(),
    }


# ---------------------------------------------------------------- loading the artifact


def hf_dir(model_dir: Path) -> Path:
    """The save_pretrained folder of a model artifact (the artifact folder or its model/ sub-folder)."""
    model_dir = Path(model_dir)
    return model_dir / "model" if (model_dir / "model" / LOAD_INFO).is_file() else model_dir


def load_info(model_dir: Path) -> dict[str, Any]:
    path = hf_dir(model_dir) / LOAD_INFO
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        raise ConfigError(f"{path}: not a model stage artifact (missing {LOAD_INFO}); run the model stage "
                          f"first") from None


def load_model(model_dir: Path) -> Any:
    """Load a `model` artifact: the saved class, quantized layers restored from the bitsandbytes
    serialisation, fp32 compute on CPU (the saved dtypes on a GPU)."""
    import transformers

    _quiet()
    folder = hf_dir(model_dir)
    info = load_info(folder)
    cls = getattr(transformers, info["model_class"], None) or auto_class(info["task"])
    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = {"dtype": DTYPES[info["dtype"]] if on_gpu else torch.float32,
                              "trust_remote_code": info.get("trust_remote_code", False)}
    if on_gpu and info["quantization"] != "none":
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    with fp32_modules_quantized(cls, info.get("quantize_fp32_modules", False)):
        model = cls.from_pretrained(folder, **kwargs)
    if not on_gpu:
        for mod in model.modules():
            if hasattr(mod, "compute_dtype"):  # Linear4bit saved with a 16-bit compute dtype on a GPU
                mod.compute_dtype = torch.float32
    return model
