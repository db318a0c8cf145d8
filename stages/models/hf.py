"""Locating and loading Hugging Face models and tokenizers: hub ids (with revision), local folders,
GGUF files, and files inside installed packages (`pkg:`)."""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path
from typing import Any

from stages.engine.errors import ConfigError
from stages.models.gguf import loadable
from stages.pipeline.schema import PipelineConfig
from stages.sources.hub import ensure_hub_reachable, hub_config_file, hub_identity, resolve_local

IGNORE_INDEX = -100  # the label of positions without loss (PyTorch's default ignore_index)

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
    was converted to once (stages/models/gguf.py); `local` stays the file, which keys hash."""
    source, kwargs, local = split_gguf(name, gguf_file)
    if "gguf_file" in kwargs and local is not None and local.is_file():
        source, kwargs = loadable(local, part)
    return source, kwargs, local


PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
SAFE_ENTRIES = ("model.safetensors", "model.safetensors.index.json")  # what from_pretrained loads from a folder
DCP_SHARD = re.compile(r"^shard-[0-9]{5}-model-[0-9]{5}-of-[0-9]{5}\.safetensors$")  # transformers' distributed shards
SAVE_AGAIN = "save the model again with save_pretrained (safetensors)"


def check_model_folder(cfg: PipelineConfig) -> None:
    """At plan time, a local model folder: its config.json parses; the weights from_pretrained would load are
    safetensors whose headers read (pickles are never loaded, whatever sits beside them); code it may run
    (check_remote_code). Each problem one ConfigError naming the folder, the file and the fix."""
    m = cfg.model
    _, _, local = split_gguf(m.name, m.gguf_file) if not m.from_config else ("", {}, None)
    folder = local if local is not None and local.is_dir() else None
    config = folder_config(folder) if folder is not None else None
    check_remote_code(cfg)  # then: for a folder with its own code, the flag is what to know about
    if folder is not None and config is not None:
        check_weights(folder, config)


def folder_config(local: Path) -> dict[str, Any]:
    """A model folder's config.json, parsed: a JSON object with a model_type (ConfigError otherwise)."""
    where, path = f"model.name {local}", local / "config.json"
    if not path.is_file():
        raise ConfigError(f"{where}: no config.json in the folder; give a folder saved with save_pretrained, a "
                          f".gguf file, or set model.from_config for random weights")
    try:
        config = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: config.json is not valid JSON ({e.msg}: line {e.lineno} column {e.colno}); "
                          f"fix it, or {SAVE_AGAIN}") from None
    except (OSError, ValueError) as e:  # unreadable; not UTF-8
        raise ConfigError(f"{where}: config.json cannot be read ({e}); fix it, or {SAVE_AGAIN}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError(f"{where}: config.json has no model_type (e.g. \"bert\", \"llama\"); fix it, or "
                          f"{SAVE_AGAIN}")
    return config


def check_weights(local: Path, config: dict[str, Any]) -> None:
    """What from_pretrained(local, use_safetensors=True) would read is safetensors (transformers still follows a
    config.json's transformers_weights, a sharded index's file names and an adapter's adapter_model.bin to
    torch.load), and every *.safetensors file's header reads."""
    where = f"model.name {local}"
    never = "which are never loaded here (unpickling can run code)"
    explicit = config.get("transformers_weights")
    if explicit is not None and not str(explicit).endswith((".safetensors", ".safetensors.index.json")):
        raise ConfigError(f"{where}: config.json's transformers_weights names {explicit}, not a safetensors file, "
                          f"{never}; remove the key and {SAVE_AGAIN}")
    if (local / "adapter_config.json").is_file() and not (local / "adapter_model.safetensors").is_file():
        raise ConfigError(f"{where}: an adapter (adapter_config.json) without adapter_model.safetensors; its "
                          f"weights are pickles or missing, {never}; save it with save_pretrained (safetensors)")
    safe = sorted(local.glob("*.safetensors"))
    names = [str(explicit)] if explicit is not None else list(SAFE_ENTRIES)
    entry = next((local / n for n in names if (local / n).is_file()), None)
    if entry is None and not any(DCP_SHARD.match(p.name) for p in safe):
        pickles = sorted(p.name for pattern in PICKLES for p in local.glob(pattern))
        if pickles:
            beside = f" ({', '.join(p.name for p in safe[:3])} beside them is not model.safetensors)" if safe else ""
            raise ConfigError(f"{where}: its weights are pickles ({', '.join(pickles[:3])}), {never}{beside}; "
                              f"convert them to safetensors on a machine you trust "
                              f"(model.save_pretrained(folder, safe_serialization=True))")
        if safe:
            raise ConfigError(f"{where}: no {' or '.join(names)} in the folder ({', '.join(p.name for p in safe[:3])} "
                              f"is not what from_pretrained reads); {SAVE_AGAIN}")
        raise ConfigError(f"{where}: no weights (*.safetensors) in the folder; give a folder saved with "
                          f"save_pretrained, a .gguf file, or set model.from_config for random weights")
    if entry is not None and entry.name.endswith(".index.json"):
        try:
            shards = set(json.loads(entry.read_bytes())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{where}: {entry.name} is not a shard index ({type(e).__name__}: {e}); "
                              f"{SAVE_AGAIN}") from None
        for shard in sorted(map(str, shards)):
            if not shard.endswith(".safetensors"):
                raise ConfigError(f"{where}: {entry.name} names the shard {shard}, not a safetensors file, "
                                  f"{never}; {SAVE_AGAIN}")
            if not (local / shard).is_file():
                raise ConfigError(f"{where}: {entry.name} names the shard {shard}, which is not in the folder; "
                                  f"copy it there or {SAVE_AGAIN}")
    for f in safe:
        st = f.stat()
        problem = _safetensors_problem(str(f), st.st_size, st.st_mtime_ns)
        if problem:
            raise ConfigError(f"{where}: {f.name} is not a readable safetensors file ({problem}); remove it or "
                              f"{SAVE_AGAIN}")


@functools.lru_cache(maxsize=64)
def _safetensors_problem(path: str, size: int, mtime_ns: int) -> str | None:
    """Why a safetensors file's header does not read (its header only: no tensor is loaded), else None."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        return str(e).removeprefix("Error while deserializing header: ")
    return None


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


VOCABULARIES = ("tokenizer.json", "vocab.txt", "vocab.json")  # besides *.model (sentencepiece) and *.tiktoken
SPECIAL_LOOKING = re.compile(r"^(\[[^\[\]\s]+\]|<[^<>\s]+>)$")  # [PAD], [unused3], <s>, <|endoftext|>


def check_tokenizer_folder(cfg: PipelineConfig) -> None:
    """At plan time, a local tokenizer folder (tokenize.tokenizer, else the model's folder) holds a vocabulary
    with more than special tokens: without one, transformers builds an empty tokenizer that reads every word
    as unknown and training goes on (ConfigError naming the folder and the fix)."""
    gguf = None if cfg.tokenize.tokenizer else cfg.model.gguf_file
    _, _, local = split_gguf(tokenizer_name(cfg), gguf)
    if local is None or not local.is_dir():
        return
    setting = "tokenize.tokenizer" if cfg.tokenize.tokenizer else "model.name"
    fix = ("copy the model's tokenizer files (tokenizer.json, or vocab.txt / vocab.json and merges.txt, or a "
           "sentencepiece *.model) into the folder, or set tokenize.tokenizer to a folder, hub id or pkg: path "
           "that has them")
    files = {p.name: p for p in local.iterdir() if p.is_file() and (p.name in VOCABULARIES or
                                                                       p.suffix in (".model", ".tiktoken"))}
    if not files:
        raise ConfigError(f"{setting} {local}: no tokenizer files ({', '.join(VOCABULARIES)}, *.model) in the "
                          f"folder, so every word would be read as unknown; {fix}")
    name = next((n for n in VOCABULARIES if n in files), None)
    if name is None:  # sentencepiece / tiktoken: their size needs their own libraries
        return
    st = files[name].stat()
    try:
        words, specials = _vocabulary(str(files[name]), st.st_size, st.st_mtime_ns)
    except Exception as e:  # noqa: BLE001 - whatever the tokenizers library or JSON say of a broken file
        raise ConfigError(f"{setting} {local}: {name} cannot be read ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                          f"{fix}") from None
    if not words:
        raise ConfigError(f"{setting} {local}: the vocabulary of {name} is only its special tokens "
                          f"({', '.join(specials[:5]) or 'none'}), so every word would be read as unknown; {fix}")


@functools.lru_cache(maxsize=16)
def _vocabulary(path: str, size: int, mtime_ns: int) -> tuple[int, list[str]]:
    """(tokens that are not special, the special ones) of a tokenizer.json, vocab.txt or vocab.json."""
    p = Path(path)
    if p.name == "tokenizer.json":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        vocab = set(tok.get_vocab(with_added_tokens=True))
        declared = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    elif p.name == "vocab.json":
        vocab, declared = set(json.loads(p.read_bytes())), set()
    else:
        vocab, declared = {line.rstrip("\r\n") for line in p.read_text(encoding="utf-8").splitlines()} - {""}, set()
    specials = sorted(t for t in vocab if t in declared or SPECIAL_LOOKING.match(t))
    return len(vocab) - len(specials), specials


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
