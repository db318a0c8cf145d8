"""A local GGUF file as plain Hugging Face folders, converted once per file content and transformers version.

transformers reads a GGUF's metadata (its whole vocabulary) in Python and dequantizes its tensors on every load:
SmolLM2-135M-Instruct's 98 MB file took 4 CPU-s to give a tokenizer and 16 to give a model (bench/gguf_load.py),
in every process that asks (tokenize, model, evaluate, export, each test). Converted once into
`$FINETUNE_CACHE/gguf/` (config.json, model.safetensors in fp32, the tokenizer's files), a later load reads those
in a fraction of a second. What was loaded is what transformers' own GGUF loader gave: the conversion is that
loader's result, saved with save_pretrained.

The cache never stands in for another file: a folder is named by the GGUF's sha256, the transformers
version and the digest of the code that converted it, and is written whole under a temporary name, then
renamed (a folder that exists is complete). The store's keys still read the GGUF file itself (stages/models/hf.py)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import shutil
import uuid
from pathlib import Path
from typing import Any

from stages.engine.fingerprint import HashMemo
from stages.engine.paths import cache_dir

log = logging.getLogger("finetune.model")

PARTS = ("config", "tokenizer", "model")


def cache_root() -> Path:
    return cache_dir() / "gguf"


@functools.lru_cache(maxsize=4)
def _memo(path: Path) -> HashMemo:
    return HashMemo(path)


@functools.lru_cache(maxsize=1)
def _converter_digest() -> str:
    """The conversion's own code (this module and the transformers workaround it calls): an edit to either
    names new folders, so a conversion made by older code is never read again."""
    compat = importlib.util.find_spec("stages.models.compat.transformers")  # its file, without importing torch
    assert compat is not None and compat.origin
    return hashlib.sha256(Path(__file__).read_bytes() + Path(compat.origin).read_bytes()).hexdigest()


def loadable(path: Path, part: str) -> tuple[str, dict[str, Any]]:
    """What from_pretrained takes for `part` of the GGUF file `path`: its converted folder, or, where the cache
    cannot be written (read-only, full, not a folder), the file itself as transformers reads it, with a warning."""
    try:
        return str(converted(path, part)), {}
    except OSError as e:
        log.warning("%s: not converted (%s); read from the GGUF each time instead: set FINETUNE_CACHE to a "
                    "writable folder to convert it once", path.name, e)
        return str(path.parent), {"gguf_file": path.name}


def converted(path: Path, part: str) -> Path:
    """The folder holding `part` (config, tokenizer or model) of the GGUF file `path`, converting it on the
    first ask; load it with from_pretrained(folder) and no gguf_file."""
    import transformers

    assert part in PARTS, part
    root = cache_root()
    digest = _memo(root / "hashes.db").sha256(path)
    folder = root / f"{digest[:32]}-transformers-{transformers.__version__}-code-{_converter_digest()[:8]}" / part
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tmp-{part}-{uuid.uuid4().hex[:8]}"
    try:
        _convert(path, part, tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process converted it first: theirs is the same
            if not folder.is_dir():
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
    return folder


def _convert(path: Path, part: str, out: Path) -> None:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from stages.models.compat.transformers import clear_gguf_quantizer

    hf_logging.set_verbosity_error()
    source, name = str(path.parent), path.name
    if part == "tokenizer":
        log.info("%s: its tokenizer converted once to %s", path.name, out.parent)
        AutoTokenizer.from_pretrained(source, gguf_file=name).save_pretrained(out)
        return
    config = AutoConfig.from_pretrained(source, gguf_file=name)
    if part == "config":
        config.save_pretrained(out)
        return
    import torch

    log.info("%s: dequantized once to %s", path.name, out.parent)
    cls: Any = next((c for c in (AutoModelForCausalLM, AutoModelForSeq2SeqLM) if type(config) in c._model_mapping),
                    AutoModel)
    model = cls.from_pretrained(source, gguf_file=name, config=config, dtype=torch.float32)
    clear_gguf_quantizer(model)
    model.save_pretrained(out)
