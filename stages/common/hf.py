"""Locating and loading Hugging Face models and tokenizers: hub ids (with revision), local folders,
GGUF files, and files inside installed packages (`pkg:`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from stages.common.gguf import loadable
from stages.common.hub import ensure_hub_reachable, hub_config_file, hub_identity, resolve_local
from stages.engine.errors import ConfigError
from stages.engine.schema import PipelineConfig

log = logging.getLogger("finetune.model")

HUB_FIX = ("use a local copy: set model.name (or tokenize.tokenizer) to a folder, a .gguf file or "
           "pkg:PACKAGE/PATH, or download it into the HF cache on a connected machine and set HF_HUB_OFFLINE=1")


def split_gguf(name: str, gguf_file: str | None) -> tuple[str, dict[str, Any], Path | None]:
    """(what to pass to from_pretrained, extra kwargs, local path or None for a hub id)."""
    local = resolve_local(name)
    if local is not None and local.is_file() and local.suffix == ".gguf":
        return str(local.parent), {"gguf_file": local.name}, local
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if local is not None:
        return str(local), kwargs, (local / gguf_file if gguf_file else local)
    return name, kwargs, None


def pretrained_source(name: str, gguf_file: str | None, part: str) -> tuple[str, dict[str, Any], Path | None]:
    """split_gguf for loading: a local GGUF file's `part` (config, tokenizer, model) is read from the folder it
    was converted to once (stages/common/gguf.py); `local` stays the file, which keys hash."""
    source, kwargs, local = split_gguf(name, gguf_file)
    if "gguf_file" in kwargs and local is not None and local.is_file():
        source, kwargs = loadable(local, part)
    return source, kwargs, local


PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def check_model_folder(cfg: PipelineConfig) -> None:
    """At plan time, a local model folder: weights this project loads (safetensors; pickles never are) and
    code it may run (check_remote_code)."""
    check_remote_code(cfg)  # first: for a folder with its own code, the flag is what to know about
    m = cfg.model
    _, _, local = split_gguf(m.name, m.gguf_file) if not m.from_config else ("", {}, None)
    if local is not None and local.is_dir() and (local / "config.json").is_file() \
            and not any(local.glob("*.safetensors")):
        pickles = sorted(p.name for pattern in PICKLES for p in local.glob(pattern))
        if pickles:
            raise ConfigError(f"model.name {local}: its weights are pickles ({', '.join(pickles[:3])}), which are "
                              f"never loaded here (unpickling can run code); convert them to safetensors on a "
                              f"machine you trust (model.save_pretrained(folder, safe_serialization=True))")
        raise ConfigError(f"model.name {local}: no weights (*.safetensors) in the folder; give a folder saved "
                          f"with save_pretrained, a .gguf file, or set model.from_config for random weights")


def check_remote_code(cfg: PipelineConfig) -> None:
    """A model whose config.json maps to its own Python (`auto_map`, a model type transformers lacks), in a local
    folder or a hub repo (its config.json from the HF cache, or fetched alone): refused while
    model.trust_remote_code is off (ConfigError naming the flag), announced by a warning every run while it is on."""
    m = cfg.model
    if m.from_config:
        return
    _, _, local = split_gguf(m.name, m.gguf_file)
    if local is not None:
        where = str(local)
        config_file = local / "config.json" if local.is_dir() and (local / "config.json").is_file() else None
    else:
        where = f"{m.name} (hub)"
        config_file = hub_config_file(m.name, m.revision)
    code: list[str] = []
    config: Any = None
    if config_file is not None:
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError):
            return  # not JSON: loading says so
        auto_map = config.get("auto_map") if isinstance(config, dict) else None
        if isinstance(auto_map, dict) and auto_map:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            if config.get("model_type") not in CONFIG_MAPPING:  # else transformers uses its own classes
                refs = [v for vs in auto_map.values() for v in (vs if isinstance(vs, list) else [vs]) if v]
                code = sorted({f"{str(r).split('--')[-1].rsplit('.', 1)[0]}.py" for r in refs})
    if m.trust_remote_code:
        what = f"{where}'s Python files ({', '.join(code)})" if code else f"Python files that {m.name} ships"
        log.warning("model.trust_remote_code is on: %s will run in this process, with your permissions", what)
    elif code:
        raise ConfigError(f"model.name {where}: its config.json asks to run its own Python ({', '.join(code)}; "
                          f"model type {config.get('model_type')!r} is not in transformers); set "
                          f"model.trust_remote_code: true if you trust that code (it runs in this process)")


def tokenizer_name(cfg: PipelineConfig) -> str:
    return cfg.tokenize.tokenizer or cfg.model.name


def tokenizer_files(cfg: PipelineConfig) -> list[Path]:
    """Files whose content identifies a local tokenizer (a hub tokenizer is identified by id + revision)."""
    gguf = None if cfg.tokenize.tokenizer else cfg.model.gguf_file
    _, _, local = split_gguf(tokenizer_name(cfg), gguf)
    if local is None:
        return []
    if local.is_file():
        return [local]
    return sorted(p for p in local.iterdir() if p.is_file() and
                  (p.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "spiece", "added_tokens",
                                       "chat_template"))
                   or p.suffix in (".model", ".tiktoken")))


def tokenizer_deps(cfg: PipelineConfig) -> dict[str, str]:
    """A hub tokenizer pinned to the commit its revision points at ({} for a local one)."""
    gguf = None if cfg.tokenize.tokenizer else cfg.model.gguf_file
    source, _, local = split_gguf(tokenizer_name(cfg), gguf)
    return {} if local is not None else hub_identity(source, cfg.model.revision)


def model_deps(cfg: PipelineConfig) -> dict[str, str]:
    """A hub model pinned to the commit its revision points at, with the tokenizer its pad token comes from."""
    deps = tokenizer_deps(cfg)
    if not cfg.model.from_config:
        source, _, local = split_gguf(cfg.model.name, cfg.model.gguf_file)
        if local is None:
            deps |= hub_identity(source, cfg.model.revision)
    return deps


def load_tokenizer(source: Any):
    """The one tokenizer loader, with a pad token. `source`: a pipeline config (tokenize.tokenizer, else the
    model's: hub id, folder, GGUF file or pkg:), or the folder of a saved tokenizer (the tokenize artifact's
    tokenizer/)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    if isinstance(source, str | Path):
        tok = AutoTokenizer.from_pretrained(str(source))
    else:
        cfg = source
        gguf = None if cfg.tokenize.tokenizer else cfg.model.gguf_file
        name, kwargs, local = pretrained_source(tokenizer_name(cfg), gguf, "tokenizer")
        if local is None:
            ensure_hub_reachable(f"tokenizer {name}", HUB_FIX, name, cfg.model.revision)
        hf_logging.set_verbosity_error()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        tok = AutoTokenizer.from_pretrained(name, revision=cfg.model.revision if local is None else None,
                                            trust_remote_code=cfg.model.trust_remote_code, **kwargs)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return tok


def special_affixes(tok: Any) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text (e.g. [CLS] ... [SEP])."""
    bare = tok("x", add_special_tokens=False)["input_ids"]
    full = tok("x")["input_ids"]
    start = next(i for i in range(len(full)) if full[i:i + len(bare)] == bare)
    return full[:start], full[start + len(bare):]


def model_files(cfg: PipelineConfig) -> list[Path]:
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


def model_input_files(cfg: PipelineConfig) -> list[Path]:
    """The model stage's input files: the local checkpoint, and the tokenizer a pad token id may come from."""
    return sorted(set(model_files(cfg)) | set(tokenizer_files(cfg)))
