"""export.formats hf (always listed): the Hugging Face folder at the top of the export. export.layout
(stages/formats/export_layout.py) says what sits there: a full finetune's model; the LoRA merged into the base
(dequantized when 4/8-bit, in export.merged_dtype), the adapter alone in adapter/ beside it; or the PEFT adapter
at the top (its base named by hub id and pinned commit), merged/ beside it with export.merge. The tokenizer,
generation config and card are the export stage's (stages/export.py), written for every format.

torch, transformers and peft are imported where the weights are written: the plan imports this module."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from stages.engine.errors import ConfigError
from stages.formats.export_layout import top_layout
from stages.formats.format import ExportJob, Format

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def export_adapter(trained: Path, out: Path, base_name: str, revision: str | None = None) -> None:
    """The trained PEFT adapter (its two files), with the base recorded by name (not a store path) and, for
    a hub base, the pinned commit."""
    from stages.models.model_loading import write_adapter_config

    out.mkdir(parents=True, exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy2(trained / name, out / name)
    write_adapter_config(out / "adapter_config.json", base_model_name_or_path=base_name, revision=revision)


def untie_if_diverged(model: PreTrainedModel) -> bool:
    """A trained lm_head (LoRA modules_to_save) no longer equals the tied input embeddings: save both,
    or a reload would tie lm_head back to the untrained embeddings."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or out.weight is inp.weight:
        return False
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(cfg, "tie_word_embeddings", False):
        return False
    import torch

    if torch.equal(cast(torch.Tensor, out.weight), cast(torch.Tensor, inp.weight)):
        return False
    cfg.tie_word_embeddings = False
    model.config.tie_word_embeddings = False
    return True


def merged_model(model_dir: Path, adapter_dir: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, dict[str, Any]]:
    """The base (dequantized when 4/8-bit) in `dtype` with the LoRA weights merged in."""
    from stages.models.model_loading import load_info, load_model

    info = load_info(model_dir)
    base = load_model(model_dir)
    if info["quantization"] != "none":
        base = base.dequantize(dtype=dtype)
    base = base.to(dtype)
    from stages.models.compat.peft import peft_dispatch
    from stages.models.compat.transformers import drop_quantization_config

    with peft_dispatch(base) as peft:
        merged = peft.PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.eval()
    untied = untie_if_diverged(merged)
    drop_quantization_config(merged)  # plain weights now
    merged.config.dtype = dtype
    return merged, {"dequantized_from": info["quantization"] if info["quantization"] != "none" else None,
                    "untied_lm_head": untied}


def save_hf(model: PreTrainedModel, out: Path, gen: Any) -> None:
    if gen is not None:
        model.generation_config = gen
    model.save_pretrained(str(out), safe_serialization=True)


class HuggingFace(Format):
    name = "hf"
    from_merged = False
    libraries = ("torch", "transformers", "peft", "bitsandbytes", "safetensors")

    def check(self, cfg: Any) -> None:
        top_layout(cfg)  # raises where the adapter at the top could not load alone

    def write(self, job: ExportJob) -> dict[str, Any]:
        """The weights at the top (and adapter/ or merged/ beside them); the facts for the manifest."""
        from stages.models.model_loading import DTYPES, LOAD_INFO, load_trained

        cfg, x, out, fmt = job.cfg, job.cfg.export, job.out, job.layout
        model_dir, train_dir = job.upstream["model"], job.upstream["train"]
        trained, dtype, method = train_dir / "trained", DTYPES[x.merged_dtype], cfg.adapters.method
        facts: dict[str, Any] = {}
        if method == "lora":
            if fmt == "adapter":
                export_adapter(trained, out, cfg.model.name, job.revision)
                if job.gen is not None:
                    job.gen.save_pretrained(str(out))
            else:
                export_adapter(trained, out / "adapter", cfg.model.name, job.revision)
            if fmt == "merged" or x.merge:
                merged, more = merged_model(model_dir, trained, dtype)
                save_hf(merged, job.merged_at, job.gen)
                if job.merged_at != out:
                    job.tok.save_pretrained(str(job.merged_at))
                facts.update(merged=True, dtype=x.merged_dtype, **more)
        elif method == "full":
            if not (trained / LOAD_INFO).is_file():
                raise ConfigError(f"{trained}: not a full-finetune model; rerun the train stage")
            loaded: Any = load_trained(model_dir, job.upstream["adapters"], train_dir)  # (PreTrainedModel.to's stub)
            model = loaded.to(dtype)
            model.config.dtype = dtype
            save_hf(model, out, job.gen)
            facts.update(dtype=x.merged_dtype)
        else:  # pragma: no cover - AdaptersConfig allows only these
            raise ConfigError(f"adapters.method {method}: cannot export")
        (out / LOAD_INFO).unlink(missing_ok=True)
        return facts

    def card_lines(self, job: ExportJob, facts: dict[str, Any]) -> dict[str, str]:
        cfg, lines = job.cfg, {}
        if cfg.adapters.method == "lora" and job.layout != "adapter":
            lines["adapter"] = (f"the PEFT adapter alone, for `PeftModel.from_pretrained(base, 'adapter')` on the "
                                f"base `{cfg.model.name}`")
        if facts.get("merged") and job.merged_at != job.out:
            lines["merged"] = f"the base with the LoRA merged in, {cfg.export.merged_dtype}, safetensors + tokenizer"
        return lines


FORMAT = HuggingFace()
