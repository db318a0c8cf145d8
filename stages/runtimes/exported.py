"""Running an export folder (stages/export.py writes it) on new text: loaded the way a user loads it, with the
tokenizer and the Auto class alone (AutoPeftModelFor... for an adapter at the top), the texts tokenized as
the tokenize stage tokenizes (prefix, truncation at tokenize.max_length, the causal prompt without its
closing special), then the evaluate stage's batched inference (stages/models/inference.py): labels with
probabilities for a classifier, generated text for seq2seq / causal_lm.

A chat export (a causal LM whose tokenizer has a chat template: the one its conversations were rendered
with) also answers conversations: each rendered with the template and its assistant cue
(add_generation_prompt), as `tokenizer.apply_chat_template` renders it, generated in batches padded on the
left (with the KV cache, greedy as evaluate), each row stopping at the end-of-turn token
(generation_config.json). Nothing here imports Prefect or opens the store."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.engine.errors import ConfigError, NonFiniteOutputError
from stages.methods.base import Method
from stages.methods.registry import method_of
from stages.models.inference import device_for
from stages.models.model_loading import quiet_transformers
from stages.pipeline.schema import LEGACY_TASKS
from stages.runtimes import runtime_of
from stages.training.device import Precision, autocast, resolve_precision

PIPELINE_JSON = "finetune_pipeline.json"  # stages/export.py writes it beside the model
log = logging.getLogger("finetune.predict")


def method_name(settings: dict[str, Any]) -> str:
    """The method of an export's pipeline settings (an export of before methods names its model.task)."""
    if "method" in settings:
        return str(settings["method"]["name"])
    return LEGACY_TASKS[settings["model"]["task"]]


@dataclass
class Exported:
    folder: Path
    model: Any
    tok: Any
    method: Method
    prefix: str
    max_length: int
    generation: dict[str, Any]  # generate() kwargs: the evaluate stage's settings (generation_config.json)
    precision: str = "auto"  # train.mixed_precision as resolved for the run (the evaluate stage's autocast)
    runtime: str = "torch"  # its name in RUNTIMES (stages/runtimes/__init__.py)


def is_export(folder: Path) -> bool:
    return (folder / PIPELINE_JSON).is_file() and any(
        (folder / f).is_file() for f in ("config.json", "adapter_config.json"))


# A tokenizer loads from one of these (save_pretrained writes tokenizer.json for a fast tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "vocab.txt")


def export_settings(folder: Path) -> dict[str, Any]:
    """The export's pipeline settings (finetune_pipeline.json), once the files loading reads are checked: every
    JSON file parses, a tokenizer is there, every safetensors header reads (a file cut short or overwritten
    fails here). A damaged or partial folder is one line naming the file, not a library's traceback."""
    from safetensors import SafetensorError, safe_open

    from stages.sources.tables import one_line

    def damaged(name: str, why: str) -> ConfigError:
        return ConfigError(f"export {folder}: {name} {why}; export the pipeline again (finetune inspect verify "
                           f"finds damaged artifacts in the store)")

    for f in sorted(folder.glob("*.json")):
        try:
            json.loads(f.read_bytes())
        except (OSError, ValueError) as e:
            raise damaged(f.name, f"cannot be read as JSON ({one_line(e)})") from None
    settings = json.loads((folder / PIPELINE_JSON).read_bytes())
    try:
        method_of(method_name(settings)), settings["tokenize"]["max_length"], settings["tokenize"]["prefix"]
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        why = f"no {e}" if isinstance(e, KeyError) else one_line(e)
        raise damaged(PIPELINE_JSON, f"is not an export's settings ({why})") from None
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise damaged("the folder", f"has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt"):
                pass
        except (OSError, SafetensorError) as e:
            raise damaged(f.name, f"is not a readable safetensors file ({one_line(e)})") from None
    return settings


def load_export(folder: Path | str, chat: bool = False, runtime: str = "torch") -> Exported:
    """The folder's tokenizer and model (eval mode), on the GPU when there is one. `chat`: to answer
    conversations, refused (before the model loads) for an export that has no chat template. `runtime`: a name in
    RUNTIMES (stages/runtimes/__init__.py), which loads the folder (torch: the Hugging Face model; onnx: its ONNX
    files in onnxruntime; gguf: its GGUF file in llama.cpp)."""
    import transformers

    folder = Path(folder)
    engine = runtime_of(runtime)
    if chat and not engine.answers_chats:
        raise ConfigError(engine.chat_refusal())
    if not is_export(folder):
        raise ConfigError(f"{folder}: not an export folder (no {PIPELINE_JSON} beside a config.json or "
                          f"adapter_config.json); give a pipeline name or the export stage's folder")
    settings = export_settings(folder)
    quiet_transformers()
    method = method_of(method_name(settings))
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    if chat:
        refuse_chat(folder, method, tok)
    generation: dict[str, Any] = {}
    if method.head.generates:
        gen = transformers.GenerationConfig.from_pretrained(str(folder))
        generation = {"generation_config": gen}
    max_length = settings["tokenize"]["max_length"]
    engine.refuse(folder, method)
    model = engine.load(folder, method)
    model.eval()
    return Exported(folder, model, tok, method, settings["tokenize"]["prefix"], max_length,
                    generation, settings.get("train", {}).get("mixed_precision", "auto"), runtime)


def token_ids(ex: Exported, texts: list[str]) -> list[list[int]]:
    """The tokenize stage's input ids: prefix + text, truncated keeping the closing specials; a causal prompt
    without them (evaluate's prompt_of)."""
    ids = ex.tok([ex.prefix + t for t in texts], truncation=True, max_length=ex.max_length)["input_ids"]
    return ex.method.prompt_ids(ex.tok, ids)


def refuse_chat(folder: Path, method: Method, tok: Any) -> None:
    """A conversation needs a decoder and a chat template to render it with."""
    if not method.head.decoder_only:
        raise ConfigError(f"--chat / --messages-column: {folder} is a {method.name} export ({method.head.pipeline_tag}), "
                          f"not a chat model; give --text or --file with a text column")
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"--chat / --messages-column: {folder} has no chat template (its tokenizer has none: the "
                          f"model was tuned on plain text); give --text, or export a pipeline with data.format "
                          f"messages")


def chat_ids(ex: Exported, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
    """Conversations ending in a user turn -> prompt ids: rendered with the export's chat template and the
    assistant cue, tokenized with no specials added (the template writes them), as apply_chat_template does
    and as the tokenize stage tokenizes a conversation. Longer than tokenize.max_length: the oldest exchanges
    go first (a system turn stays), then the head, as the tokenize stage cuts a conversation."""
    def ids(turns: list[dict[str, str]]) -> list[int]:
        text = ex.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        return list(ex.tok(text, add_special_tokens=False)["input_ids"])

    out = []
    for turns in conversations:
        x = ids(turns)
        while len(x) > ex.max_length and sum(t["role"] == "assistant" for t in turns):
            first = next(i for i, t in enumerate(turns) if t["role"] == "assistant")
            turns = [t for i, t in enumerate(turns) if t["role"] == "system" or i > first]
            x = ids(turns)
        out.append(x[-ex.max_length:])
    return out


def export_precision(ex: Exported, device: Any) -> Precision:
    """The precision the run's evaluate stage computed in (train.mixed_precision, resolved on the machine that
    trained): predictions then match predictions.jsonl on any machine. fp16 off a GPU cannot run: auto then."""
    if ex.precision == "auto" or (ex.precision == "fp16" and getattr(device, "type", device) != "cuda"):
        auto = resolve_precision("auto", device)
        why = "records no resolved precision" if ex.precision == "auto" else "was evaluated in fp16, a GPU's"
        return Precision(auto.name, f"the export {why}; {auto.reason}")
    return Precision(ex.precision, f"as the export was evaluated (train.mixed_precision {ex.precision})")


# Rows per forward pass when none is given: on a CPU, batches of 4-8 ran fastest and 32 up to 1.4x slower (the
# GEMMs of a big batch of long rows leave the cache; docs/export.md#batch-size); a GPU wants big batches.
CPU_BATCH, GPU_BATCH = 8, 32


def predict(ex: Exported, texts: list[str], batch_size: int | None = None, overrides: dict[str, Any] | None = None,
            precision: str = "export", conversations: list[list[dict[str, str]]] | None = None
            ) -> list[dict[str, Any]]:
    """One record per text (or per conversation, given `conversations` instead: the assistant's answer), in
    order: {"label", "probability", "probabilities"} or {"generated"}. The forward passes autocast in
    `precision`: export (the precision evaluate used, so its predictions reproduce), or auto (bf16 on GPUs and
    CPUs with bf16 units, else fp32), no, bf16, fp16."""
    import torch

    if conversations is not None:
        refuse_chat(ex.folder, ex.method, ex.tok)
    ids = token_ids(ex, texts) if conversations is None else chat_ids(ex, conversations)
    engine = runtime_of(ex.runtime)
    if engine.own_precision:  # e.g. onnxruntime / llama.cpp: the file's own precision; autocast does not reach
        device = torch.device("cpu")
        chosen = Precision("no", f"{engine.engine} runs {ex.model.path.name} in its own precision")
        log.info("predict: runtime %s on the CPU, %s", engine.engine, chosen.reason)
    else:
        device = device_for(ex.model)
        chosen = export_precision(ex, device) if precision == "export" else resolve_precision(precision, device)
        log.info("predict: device %s, precision %s (%s)", device, chosen.name, chosen.reason)
    batch_size = batch_size or (GPU_BATCH if device.type == "cuda" else CPU_BATCH)
    # inference_mode, not only no_grad: no version counters or views tracked (nothing here trains afterwards)
    with torch.inference_mode(), autocast(chosen, device):
        try:
            return ex.method.predict(ex.model, ex.tok, ex.generation, ids, batch_size, overrides, device, log)
        except NonFiniteOutputError as e:
            raise NonFiniteOutputError(f"export {ex.folder}: {e}; export it again from a verified store "
                                       f"(finetune inspect verify)") from None
