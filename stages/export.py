"""Export stage: the trained result in the formats people load elsewhere.

    adapter/   LoRA: the trained PEFT adapter (adapter_config.json + adapter_model.safetensors, modules_to_save
               included): `PeftModel.from_pretrained(base, "adapter")` on the model stage's base
    merged/    LoRA with export.merge: the base dequantized (when 4/8-bit) to export.merged_dtype, the LoRA
               weights merged in; safetensors + config.json + tokenizer, loadable with the Auto class alone
    model/     full finetune: the trained model itself in export.merged_dtype, with its tokenizer
    README.md  model card: pipeline name, the config, data / tokenize / model / adapters / train keys,
               training metrics, the command that reproduces it
    config.json  the same config as data

Why the card has no evaluation metrics: they are the evaluate stage's (metrics.json). Reading them would
put evaluate upstream of export, so a change of beams or max_new_tokens would re-export (and re-merge)
unchanged weights; with export independent of evaluate such a change reruns exactly one stage body. The
card names the evaluate command instead. For the same reason the card prints every section that shapes
the weights (all of them declared in the stage's reads, so the key covers what is printed) but not
`evaluate`.

The card's `--set` list is the run's own `--set` list less the evaluation and runtime settings
(`PipelineConfig.weight_overrides`, in the key). pipeline.yaml is not read (any edit of any pipeline would
re-export), so after an edit of that pipeline the command can be stale; config.json is always exact.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from typing import Any

import torch

from stages.common.models import DTYPES, LOAD_INFO, load_info, load_model, peft_dispatch
from stages.engine.errors import ConfigError
from stages.engine.runner import select
from stages.engine.schema import CARD_SECTIONS

# ---------------------------------------------------------------- weights


def export_adapter(trained: Path, out: Path, base_name: str) -> None:
    """The trained PEFT adapter, with the base recorded as the model's name (not a store path)."""
    shutil.copytree(trained, out)
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = base_name
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def untie_if_diverged(model: torch.nn.Module) -> bool:
    """A trained lm_head (LoRA modules_to_save) no longer equals the tied input embeddings: save both,
    or a reload would tie lm_head back to the untrained embeddings."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or out.weight is inp.weight:
        return False
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(cfg, "tie_word_embeddings", False):
        return False
    if torch.equal(out.weight, inp.weight):
        return False
    cfg.tie_word_embeddings = False
    model.config.tie_word_embeddings = False
    return True


def merged_model(model_dir: Path, adapter_dir: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The base (dequantized when 4/8-bit) in `dtype` with the LoRA weights merged in."""
    info = load_info(model_dir)
    base = load_model(model_dir)
    if info["quantization"] != "none":
        base = base.dequantize(dtype=dtype)
    base = base.to(dtype)
    with peft_dispatch(base) as peft:
        merged = peft.PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.eval()
    untied = untie_if_diverged(merged)
    merged.config.__dict__.pop("quantization_config", None)  # plain weights now
    merged.config.dtype = dtype
    return merged, {"dequantized_from": info["quantization"] if info["quantization"] != "none" else None,
                    "untied_lm_head": untied}


def save_hf(model: torch.nn.Module, tokenizer_dir: Path, out: Path) -> None:
    model.save_pretrained(str(out), safe_serialization=True)
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)


# ---------------------------------------------------------------- the card


def config_sections(cfg: Any) -> dict[str, Any]:
    return {s: select(cfg, s) for s in CARD_SECTIONS}


def command(name: str, sets: list[str], module: str = "flows.finetune") -> str:
    args = ["python", "-m", module, name] + [a for s in (sets or []) for a in ("--set", s)]
    return " ".join(shlex.quote(a) for a in args)


def lineage(ctx: Any) -> dict[str, str]:
    """Keys of every stage these weights came from (data through the tokenize manifest)."""
    m = ctx.upstream_manifests
    keys = {"data": m["tokenize"].get("upstream", {}).get("data", {}).get("key")}
    keys.update({s: m[s]["key"] for s in ("tokenize", "model", "adapters", "train")})
    return keys


def card(name: str, description: str | None, sections: dict[str, Any], keys: dict[str, str], train: dict[str, Any],
         files: dict[str, str], sets: list[str], facts: dict[str, Any]) -> str:
    import yaml

    task = sections["model"]["task"]
    lines = [
        "---",
        f"library_name: {'peft' if 'adapter' in files else 'transformers'}",
        "tags: [finetune]",
        "---",
        f"# {name}",
        "",
    ]
    if description:
        lines += [description, ""]
    lines += [f"Task `{task}`, base model `{sections['model']['name']}`, adapters "
              f"`{sections['adapters']['method']}`, quantization `{sections['quantization']['mode']}`.", ""]
    lines += ["## Files", ""] + [f"- `{k}/`: {v}" for k, v in files.items()] + [""]
    names = sections["data"].get("label_names") if task == "seq_cls" else None
    if names:  # also the exported config's id2label / label2id
        lines += ["## Labels", "", "| id | label |", "|---|---|"] + [f"| {i} | {n} |" for i, n in enumerate(names)]
        lines += [""]
    lines += ["## Reproduce", "", "```bash", command(name, sets), "```", ""]
    lines += ["The `--set` options are the ones this run was given (evaluation and runtime settings left "
              "out), on top of pipeline.yaml's `" + name + "` "
              "as it was then; `config.json` holds the exact values (with a changed pipeline.yaml, add its "
              "sections under `pipelines:`).", ""]
    lines += ["Evaluation metrics (accuracy / ROUGE) are the evaluate stage's `metrics.json`:", "", "```bash",
              command(name, sets, "stages") + " --only evaluate", "```", ""]
    lines += ["## Training metrics", "", "| metric | value |", "|---|---|"]
    for k in ("steps", "epochs_done", "examples", "effective_batch", "precision", "optimizer", "trainable_params",
              "total_params", "first_loss", "final_loss", "tokens_per_s", "train_seconds"):
        if train.get(k) is not None:
            v = train[k]
            lines.append(f"| {k} | {round(v, 6) if isinstance(v, float) else v} |")
    for rec in train.get("validation") or []:
        shown = ", ".join(f"{k} {v}" for k, v in rec.items() if k not in ("step", "kind"))
        lines.append(f"| validation at step {rec.get('step')} | {shown} |")
    lines += [""]
    lines += ["## Stage keys", "", "| stage | key |", "|---|---|"] + [f"| {k} | `{v}` |" for k, v in keys.items()]
    lines += [""]
    if facts:
        lines += ["## Export", "", "```json", json.dumps(facts, indent=2, sort_keys=True), "```", ""]
    lines += ["## Config", "", "```yaml", yaml.safe_dump(sections, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- the stage


def run(ctx: Any) -> dict[str, Any]:
    cfg, x = ctx.cfg, ctx.cfg.export
    model_dir, train_dir = ctx.upstream["model"], ctx.upstream["train"]
    tok_dir = ctx.upstream["tokenize"] / "tokenizer"
    trained = train_dir / "trained"
    dtype = DTYPES[x.merged_dtype]
    method = cfg.adapters.method
    files: dict[str, str] = {}
    facts: dict[str, Any] = {"method": method}
    if method == "lora":
        export_adapter(trained, ctx.out_dir / "adapter", cfg.model.name)
        files["adapter"] = "PEFT LoRA adapter: `PeftModel.from_pretrained(base, 'adapter')`"
        if x.merge:
            merged, more = merged_model(model_dir, ctx.out_dir / "adapter", dtype)
            save_hf(merged, tok_dir, ctx.out_dir / "merged")
            files["merged"] = f"base with the LoRA merged in, {x.merged_dtype}, safetensors + tokenizer"
            facts.update(merged=True, merged_dtype=x.merged_dtype, **more)
    elif method == "full":
        if not (trained / LOAD_INFO).is_file():
            raise ConfigError(f"{trained}: not a full-finetune model; rerun the train stage")
        model = load_model(trained).to(dtype).eval()
        model.config.dtype = dtype
        save_hf(model, tok_dir, ctx.out_dir / "model")
        files["model"] = f"the finetuned model, {x.merged_dtype}, safetensors + tokenizer"
        facts.update(model_dtype=x.merged_dtype)
    else:  # pragma: no cover - AdaptersConfig allows only these
        raise ConfigError(f"adapters.method {method}: cannot export")

    sections = config_sections(cfg)
    keys = lineage(ctx)
    sets = list(cfg.weight_overrides)  # the run's own --set list (evaluation and runtime settings dropped)
    train_metrics = ctx.upstream_manifests["train"].get("metrics", {})
    (ctx.out_dir / "config.json").write_text(json.dumps({"name": cfg.name, **sections}, indent=2, sort_keys=True))
    (ctx.out_dir / "README.md").write_text(card(cfg.name, cfg.description, sections, keys, train_metrics, files, sets, facts))
    ctx.log.info("export: %s", ", ".join(files))
    return {**facts, "files": sorted(files), "keys": keys, "command": command(cfg.name, sets)}
