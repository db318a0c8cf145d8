"""Running an export folder (stages/export.py writes it) on new text: loaded the way a user loads it, with the
tokenizer and the Auto class alone (AutoPeftModelFor... for an adapter at the top), the texts tokenized as
the tokenize stage tokenizes (prefix, truncation at tokenize.max_length, the causal prompt without its
closing special), then the evaluate stage's batched inference (stages/common/inference.py): labels with
probabilities for a classifier, generated text for seq2seq / causal_lm."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.common.device import Precision, autocast, resolve_precision
from stages.common.inference import device_for
from stages.common.model_loading import quiet_transformers
from stages.common.tasks import Task, task_of
from stages.engine.errors import ConfigError

PIPELINE_JSON = "finetune_pipeline.json"  # stages/export.py writes it beside the model
log = logging.getLogger("finetune.predict")


@dataclass
class Exported:
    folder: Path
    model: Any
    tok: Any
    task: Task
    prefix: str
    max_length: int
    generation: dict[str, Any]  # generate() kwargs: the evaluate stage's settings (generation_config.json)
    precision: str = "auto"  # train.mixed_precision as resolved for the run (the evaluate stage's autocast)


def is_export(folder: Path) -> bool:
    return (folder / PIPELINE_JSON).is_file() and any(
        (folder / f).is_file() for f in ("config.json", "adapter_config.json"))


def load_export(folder: Path | str) -> Exported:
    """The folder's tokenizer and model (eval mode), on the GPU when there is one."""
    import transformers

    folder = Path(folder)
    if not is_export(folder):
        raise ConfigError(f"{folder}: not an export folder (no {PIPELINE_JSON} beside a config.json or "
                          f"adapter_config.json); give a pipeline name or the export stage's folder")
    quiet_transformers()
    settings = json.loads((folder / PIPELINE_JSON).read_text())
    task = task_of(settings["model"]["task"])
    name = task.auto_class
    if (folder / "adapter_config.json").is_file():
        import peft

        model = getattr(peft, name.replace("AutoModel", "AutoPeftModel")).from_pretrained(str(folder))
    else:
        model = getattr(transformers, name).from_pretrained(str(folder))
    model.eval()
    generation: dict[str, Any] = {}
    if task.generates:
        gen = transformers.GenerationConfig.from_pretrained(str(folder))
        generation = {"generation_config": gen}
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    return Exported(folder, model, tok, task, settings["tokenize"]["prefix"], settings["tokenize"]["max_length"],
                    generation, settings.get("train", {}).get("mixed_precision", "auto"))


def token_ids(ex: Exported, texts: list[str]) -> list[list[int]]:
    """The tokenize stage's input ids: prefix + text, truncated keeping the closing specials; a causal prompt
    without them (evaluate's prompt_of)."""
    ids = ex.tok([ex.prefix + t for t in texts], truncation=True, max_length=ex.max_length)["input_ids"]
    return ex.task.prompt_ids(ex.tok, ids)


def export_precision(ex: Exported, device: Any) -> Precision:
    """The precision the run's evaluate stage computed in (train.mixed_precision, resolved on the machine that
    trained): predictions then match predictions.jsonl on any machine. fp16 off a GPU cannot run: auto then."""
    if ex.precision == "auto" or (ex.precision == "fp16" and getattr(device, "type", device) != "cuda"):
        auto = resolve_precision("auto", device)
        why = "records no resolved precision" if ex.precision == "auto" else "was evaluated in fp16, a GPU's"
        return Precision(auto.name, f"the export {why}; {auto.reason}")
    return Precision(ex.precision, f"as the export was evaluated (train.mixed_precision {ex.precision})")


def predict(ex: Exported, texts: list[str], batch_size: int = 16, overrides: dict[str, Any] | None = None,
            precision: str = "export") -> list[dict[str, Any]]:
    """One record per text, in order: {"label", "probability", "probabilities"} or {"generated"}. The forward
    passes autocast in `precision`: export (the precision evaluate used, so its predictions reproduce), or
    auto (bf16 on GPUs and CPUs with bf16 units, else fp32), no, bf16, fp16."""
    ids = token_ids(ex, texts)
    device = device_for(ex.model)
    chosen = export_precision(ex, device) if precision == "export" else resolve_precision(precision, device)
    log.info("predict: device %s, precision %s (%s)", device, chosen.name, chosen.reason)
    with autocast(chosen, device):
        return ex.task.predict(ex.model, ex.tok, ex.generation, ids, batch_size, overrides, device, log)
