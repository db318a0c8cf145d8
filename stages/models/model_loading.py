"""Building and loading models, shared by the stages: what to build from the config (class, dtypes, the
quantization plan, bitsandbytes config), the local files a model is read from, and loading a `model`
artifact (`load_model`, which reads `model/finetune.json`)."""

from __future__ import annotations

import copy
import functools
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from stages.engine.errors import ConfigError, MissingInputError
from stages.models import memory
from stages.models.compat.bitsandbytes import held_weights
from stages.models.compat.peft import peft_dispatch
from stages.models.compat.transformers import (
    fp32_modules_quantized,
    keep_in_fp32_modules,
    keys_to_not_convert,
)
from stages.models.gguf import loadable
from stages.models.heads import Head, head_named
from stages.models.hf import HUB_FIX, split_gguf
from stages.models.precision import auto_compute_dtype
from stages.models.quiet import filter_known_warnings
from stages.pipeline.schema import ModelConfig, QuantizationConfig
from stages.sources.hub import ensure_hub_reachable

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    # what the stages load and save: a transformers model, or a PeftModel, which forwards every attribute to
    # its base model (typed as that model)
    HFModel: TypeAlias = PreTrainedModel


HEAD_MODULES = ("score", "classifier", "lm_head")  # never quantized
LOAD_INFO = "finetune.json"
ADAPTERS_INFO = "adapters.json"  # written by the adapters stage: {"method": ...}
ADAPTER_SET_FIELDS = ("target_modules", "exclude_modules", "modules_to_save")  # names PEFT matches as a set
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

filter_known_warnings()  # in every process that builds or loads models: only known-harmless ones, by module

# ---------------------------------------------------------------- config -> what to build


def auto_class(head: Head | str) -> Any:
    """The transformers Auto class of a head (stages/models/heads.py), or of the head named."""
    import transformers

    return getattr(transformers, (head_named(head) if isinstance(head, str) else head).auto_class)


def compute_dtype(name: str) -> torch.dtype:
    """`auto`: bf16 on GPUs that have it, fp16 on older GPUs, fp32 on CPU (bitsandbytes' CPU kernels; training's
    bf16 on CPUs with bf16 units is train.mixed_precision's autocast, stages/training/device.py)."""
    return DTYPES[auto_compute_dtype() if name == "auto" else name]


def param_dtype(m: ModelConfig, q: QuantizationConfig) -> torch.dtype:
    """dtype of the parameters that are not quantized. `auto`: fp32 unquantized (mixed precision keeps fp32
    master weights); the compute dtype when quantized (what the QLoRA recipe loads)."""
    if m.dtype != "auto":
        return DTYPES[m.dtype]
    return compute_dtype(q.compute_dtype) if q.mode != "none" else torch.float32


def hf_config(m: ModelConfig, head: Head) -> Any:
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
            st = local.stat()  # once per file version and process
            config = copy.deepcopy(_gguf_config(str(local), st.st_size, st.st_mtime_ns))
        else:
            config = AutoConfig.from_pretrained(source, revision=m.revision if local is None else None,
                                                trust_remote_code=m.trust_remote_code, **kwargs)
    head.configure(config, m)  # a classifier's head size
    return config


@functools.lru_cache(maxsize=4)
def _gguf_config(path: str, size: int, mtime_ns: int) -> Any:
    from transformers import AutoConfig

    source, kwargs = loadable(Path(path), "config")
    return AutoConfig.from_pretrained(source, **kwargs)


def meta_model(m: ModelConfig, config: Any, head: Head, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The model's modules on the meta device: shapes and dtypes, no storage, no weights read."""
    with torch.device("meta"):
        return auto_class(head).from_config(config, dtype=dtype, trust_remote_code=m.trust_remote_code)


def meta_and_plan(m: ModelConfig, q: QuantizationConfig, config: Any, head: Head
                  ) -> tuple[PreTrainedModel, memory.QuantPlan]:
    dtype = param_dtype(m, q)
    meta = meta_model(m, config, head, dtype)
    keep, strict = (set(), set()) if q.quantize_fp32_modules else keep_in_fp32_modules(meta)
    fp32 = (keep if dtype == torch.float16 else set()) | (strict if dtype != torch.float32 else set())
    skip = keys_to_not_convert(meta) | set(HEAD_MODULES) | set(q.skip_modules)
    return meta, memory.QuantPlan(q.mode, q.double_quant, dtype, tuple(sorted(skip)), tuple(sorted(keep)),
                                  tuple(sorted(fp32)))


def bnb_config(q: QuantizationConfig, plan: memory.QuantPlan) -> Any:
    from transformers import BitsAndBytesConfig

    if q.mode == "none":
        return None
    if q.mode == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=list(plan.skip))
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.quant_type,
                              bnb_4bit_use_double_quant=q.double_quant,
                              bnb_4bit_compute_dtype=compute_dtype(q.compute_dtype),
                              llm_int8_skip_modules=list(plan.skip))




def quiet_transformers() -> None:
    filter_known_warnings()  # again at run time: pytest's catch_warnings drops import-time filters
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


# ---------------------------------------------------------------- loading the artifact


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) weights of a model, a packed 4-bit weight counted as the weights it holds: the one
    count the model, adapters and train stages report (and so the model card, from train's metrics)."""
    counts = [(held_weights(p), p.requires_grad) for p in model.parameters()]
    return sum(n for n, grad in counts if grad), sum(n for n, _ in counts)


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

    quiet_transformers()
    folder = hf_dir(model_dir)
    info = load_info(folder)
    cls = getattr(transformers, info["model_class"], None) or auto_class(info["head"])
    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = {"dtype": DTYPES[info["dtype"]] if on_gpu else torch.float32,
                              "trust_remote_code": info.get("trust_remote_code", False), "use_safetensors": True}
    if on_gpu and info["quantization"] != "none":
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    with fp32_modules_quantized(cls, info.get("quantize_fp32_modules", False)):
        model = cls.from_pretrained(folder, **kwargs)
    if not on_gpu:
        for mod in model.modules():
            if hasattr(mod, "compute_dtype"):  # Linear4bit saved with a 16-bit compute dtype on a GPU
                mod.compute_dtype = torch.float32
    return model


# ---------------------------------------------------------------- the model through the chain


def load_trainable(model_dir: Path, adapters_dir: Path, gradient_checkpointing: bool = False) -> HFModel:
    """The model ready to train: the `model` artifact (load_model), prepare_model_for_kbit_training when
    quantized, then the initial LoRA adapter loaded trainable (modules_to_save included), or for `full`
    every parameter requiring grad. `gradient_checkpointing` only reaches prepare_model_for_kbit_training
    (PEFT enables it there for k-bit models); otherwise train.enable_gradient_checkpointing owns it."""
    adapters_dir = Path(adapters_dir)
    try:
        method = json.loads((adapters_dir / ADAPTERS_INFO).read_text())["method"]
    except (OSError, ValueError, KeyError):
        raise ConfigError(f"{adapters_dir}: not an adapters stage artifact (missing {ADAPTERS_INFO}); run the adapters "
                          f"stage first") from None
    info = load_info(model_dir)
    model = load_model(model_dir)
    if method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    with peft_dispatch(model) as peft:
        if info["quantization"] != "none":
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
        return peft.PeftModel.from_pretrained(model, adapters_dir / "adapter", is_trainable=True)


def write_adapter_config(path: Path, **changes: Any) -> None:
    """Rewrite a PEFT adapter_config.json (with `changes`) so that one adapter is always the same bytes: PEFT keeps
    target_modules and exclude_modules as sets, which save_pretrained lists in an order that differs between
    processes (PYTHONHASHSEED), and each load of a classifier appends its head names to modules_to_save again.
    These become sorted lists without repeats (PEFT matches them as sets), a regex string stays as it is."""
    cfg = {**json.loads(path.read_text()), **changes}
    for name in ADAPTER_SET_FIELDS:
        if isinstance(cfg.get(name), list):
            cfg[name] = sorted(set(cfg[name]))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_adapter(model: HFModel, folder: Path) -> None:
    """A PEFT model's adapter (adapter_model.safetensors + adapter_config.json), reproducible_adapter's bytes."""
    model.save_pretrained(str(folder), safe_serialization=True)
    reproducible_adapter(folder)


def reproducible_adapter(folder: Path) -> None:
    """A PEFT save_pretrained folder, the same bytes for the same weights and settings wherever the store is: the
    config as write_adapter_config makes it, without the base's path (this machine's store folder; the loaders are
    handed the base, and the export stage writes the base's name), and without the README.md card PEFT writes
    beside it (which names that path too)."""
    (folder / "README.md").unlink(missing_ok=True)
    write_adapter_config(folder / "adapter_config.json", base_model_name_or_path=None)


def save_trained(model: HFModel, folder: Path, model_dir: Path) -> None:
    """LoRA: the PEFT adapter (reproducible_adapter, modules_to_save included); full: the whole model's
    save_pretrained (safetensors) plus the model stage's load info, so `load_model` reads it like a model
    artifact."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    if (folder / "adapter_config.json").is_file():
        reproducible_adapter(folder)
    else:
        shutil.copy2(hf_dir(model_dir) / LOAD_INFO, folder / LOAD_INFO)


def load_trained(model_dir: Path, adapters_dir: Path, train_dir: Path) -> HFModel:
    """The trained model for the evaluate/export stages (eval mode): the model stage's base with the
    trained LoRA adapter, or the trained full model. `adapters_dir` is accepted for symmetry with
    load_trainable (the trained adapter carries its own config)."""
    trained = Path(train_dir) / "trained"
    if (trained / "adapter_config.json").is_file():
        base = load_model(Path(model_dir))
        with peft_dispatch(base) as peft:
            model = peft.PeftModel.from_pretrained(base, str(trained), is_trainable=False)
    elif (trained / "config.json").is_file():
        model = load_model(trained)
    else:
        raise MissingInputError(f"{trained}: neither a PEFT adapter nor a saved model; rerun the train stage")
    return model.eval()
