"""Export stage: the trained model as a folder that plain torch + transformers (+ peft) load, offline, from the
folder path alone (`AutoTokenizer.from_pretrained(folder)` and an Auto class), and a model card.

At the top of the folder, one Hugging Face model (export.layout picks it for LoRA; see the schema):
    merged   config.json (id2label / label2id) + model.safetensors (+ generation_config.json for a generating
             model): the base (dequantized when 4/8-bit) with the LoRA merged in, in export.merged_dtype; load
             with AutoModelFor...
             adapter/ beside it: the PEFT adapter alone (its base_model_name_or_path is the pipeline's model.name)
    adapter  adapter_config.json + adapter_model.safetensors (modules_to_save included): base_model_name_or_path
             is the hub id and `revision` the commit sha the run pinned; load with AutoPeftModelFor...
             merged/ beside it with export.merge
    model    a full finetune: the trained model itself, in export.merged_dtype
plus the tokenizer files (model_max_length = tokenize.max_length), generation_config.json for seq2seq /
causal_lm (the evaluate stage's generation settings, so a bare `model.generate(**batch)` reproduces its texts),
finetune_pipeline.yaml / finetune_pipeline.json (the pipeline's settings, under names no HF tool reads as a
model config) and README.md, the card: HF front matter with the evaluated metrics, a usage snippet, the
commands that reproduce and re-evaluate it. The weights are the hf format's (stages/formats/hf.py); each other
format export.formats lists (FORMATS, stages/formats/__init__.py) then writes its folder beside them.

Export is downstream of evaluate: the card carries its metrics and generation_config.json its settings, so a
change of an evaluation setting re-exports (re-merges) unchanged weights; the card is then never behind.
The card's `--set` list is the run's own less its runtime settings (the `overrides` this stage reads: the engine drops runtime ones; in the
key); pipeline.yaml is not read (any edit of any pipeline would re-export): the commands name the shipped
finetune_pipeline.yaml, which holds every in-key setting that differs from the schema's defaults.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from stages.engine.fingerprint import canonical_json
from stages.engine.stage import StageContext, select
from stages.formats import listed_formats
from stages.formats.export_layout import hub_base, top_layout
from stages.formats.format import ExportJob
from stages.methods.base import Method
from stages.methods.registry import method_of
from stages.models.hf import load_tokenizer
from stages.models.model_loading import LOAD_INFO
from stages.pipeline.schema import CARD_SECTIONS, PipelineConfig
from stages.sources import SOURCES

PIPELINE_JSON, PIPELINE_YAML = "finetune_pipeline.json", "finetune_pipeline.yaml"


# ---------------------------------------------------------------- what goes at the top


def pinned_revision(ctx: Any) -> str | None:
    """The commit sha the model stage pinned the hub base to (its key input `hub ID@REVISION`)."""
    inputs = (ctx.upstream_manifests["model"].get("key_inputs") or {}).get("inputs") or {}
    m = ctx.cfg.model
    return inputs.get(f"hub {m.name}@{m.revision or 'main'}")


# ---------------------------------------------------------------- weights


def generation_config(model_dir: Path, e: Any, tok: Any, method: Method) -> Any:
    """The base's generation config with the evaluate stage's settings (greedy or beams, max_new_tokens, the
    closing special as end token): what evaluate generated with. None for a method that does not generate."""
    from transformers import AutoConfig, GenerationConfig

    if not method.head.generates:
        return None
    folder = Path(model_dir) / "model" if (Path(model_dir) / "model" / LOAD_INFO).is_file() else Path(model_dir)
    config = AutoConfig.from_pretrained(str(folder))
    try:
        gen = GenerationConfig.from_pretrained(str(folder))
    except OSError:
        gen = GenerationConfig.from_model_config(config)
    gen.update(**method.generation(e, tok, _Configured(config)))
    return gen


class _Configured:
    def __init__(self, config: Any) -> None:
        self.config = config


def save_tokenizer(tok_dir: Path, out: Path, t: Any, method: Method) -> Any:
    """The tokenize stage's tokenizer (with the chat template conversations were rendered with), truncating at
    tokenize.max_length by default (model_max_length), giving input_ids + attention_mask, padding decoder-only
    prompts on the left. (save_pretrained writes what init_kwargs hold: the attribute alone would not ship,
    and a batch padded on the right makes a decoder continue after its pad tokens.)"""
    tok = load_tokenizer(tok_dir)
    tok.model_max_length = t.max_length
    # the stages feed the model these two only (a BERT tokenizer on a T5 / BLOOM would add token_type_ids)
    tok.model_input_names = tok.init_kwargs["model_input_names"] = ["input_ids", "attention_mask"]
    if method.head.decoder_only:
        tok.padding_side = tok.init_kwargs["padding_side"] = "left"
    tok.save_pretrained(str(out))
    return tok


def chat_facts(tokenized: dict[str, Any], tok: Any, out: Path) -> dict[str, Any] | None:
    """A chat export's: the file holding the template the conversations were rendered with (save_pretrained
    writes chat_template.jinja, or the template inside tokenizer_config.json) and the end-of-turn token
    generation stops at. None when the tokenize stage rendered no conversations."""
    from stages.models.inference import end_of_turn

    rendered = (tokenized.get("metrics") or {}).get("chat")
    if not rendered:
        return None
    eot = end_of_turn(tok)
    template = "chat_template.jinja" if (out / "chat_template.jinja").is_file() else "tokenizer_config.json"
    return {"template": template, "template_sha256": rendered["template_sha256"], "loss_on": rendered["loss_on"],
            "end_of_turn": tok.convert_ids_to_tokens(eot) if eot is not None else tok.eos_token}


# ---------------------------------------------------------------- the card


def config_sections(cfg: PipelineConfig) -> dict[str, Any]:
    return {s: select(cfg, s) for s in CARD_SECTIONS}


def non_defaults(section: Any) -> dict[str, Any]:
    """A section's in-key values that differ from the schema's defaults, compared as the key sees them
    (canonical JSON): re-read from a pipeline file they give the same keys. (Writing a default out would not:
    `adapters.alpha`'s default is the int 16, which a file's `16` validates to the float 16.0.)"""
    out: dict[str, Any] = {}
    fields = type(section).model_fields
    for name, value in section.cache_dict().items():
        if fields[name].is_required():
            out[name] = value
            continue
        default = fields[name].get_default(call_default_factory=True)
        current = getattr(section, name)
        if hasattr(current, "cache_dict") and type(default) is type(current):
            sub = non_defaults(current)
            if sub:
                out[name] = sub
            continue
        plain = default.cache_dict() if hasattr(default, "cache_dict") else default
        if canonical_json(value) != canonical_json(plain):
            out[name] = value
    return out


def command(name: str, sets: list[str], *extra: str) -> str:
    """`finetune run` of this pipeline from the exported pipeline file, named as it sits beside the command."""
    return shlex.join(["finetune", "run", name, "--config", PIPELINE_YAML, *(a for s in sets or [] for a in ("--set", s)),
                       *extra])


def lineage(ctx: StageContext) -> dict[str, str]:
    """Keys of every stage these weights came from (data through the tokenize manifest)."""
    m = ctx.upstream_manifests
    keys = {"data": m["tokenize"].get("upstream", {}).get("data", {}).get("key")}
    keys.update({s: m[s]["key"] for s in ("tokenize", "model", "adapters", "train", "evaluate")})
    return keys


def scores(evaluated: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{split: {metric: value}}: the evaluate stage's numeric metrics (no counts, no confusion matrix)."""
    skip = ("examples", "tokens", "generated_tokens_mean", "generated_tokens_max", "confusion_matrix")
    return {split: {k: v for k, v in vals.items() if isinstance(v, int | float) and k not in skip}
            for split, vals in (evaluated.get("splits") or {}).items()}


def front_matter(name: str, sections: dict[str, Any], fmt: str, revision: str | None,
                 evaluated: dict[str, dict[str, float]]) -> str:
    import yaml

    m, d = sections["model"], sections["data"]
    tag = method_of(sections["method"]["name"]).head.pipeline_tag
    meta: dict[str, Any] = {}
    if revision is not None:  # a hub base: its id (the revision is the adapter config's)
        meta["base_model"] = m["name"]
    meta["library_name"] = "peft" if fmt == "adapter" else "transformers"
    meta["pipeline_tag"] = tag
    meta["tags"] = ["finetune"] + (["lora"] if sections["adapters"]["method"] == "lora" else [])
    dataset = d.get("hub_id") or SOURCES[d["source"]].hub_id
    if dataset:
        meta["datasets"] = [dataset]
    names = sorted({k for v in evaluated.values() for k in v})
    if names:
        meta["metrics"] = names
        meta["model-index"] = [{"name": name, "results": [
            {"task": {"type": tag}, "dataset": {"name": dataset or d["source"], "type": dataset or d["source"],
                                                 "split": split},
             "metrics": [{"type": k, "name": f"{split} {k}", "value": round(float(v), 6)} for k, v in vals.items()]}
            for split, vals in evaluated.items()]}]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def usage_snippet(method: Method, fmt: str, prefix: str, chat: bool = False) -> str:
    """Python that loads the folder with transformers (+ peft) alone and runs it on the method's example texts
    (`chat`: a batch of conversations rendered with the chat template); run it from the export folder (or set
    `folder` to its path)."""
    cls = method.head.auto_peft_class if fmt == "adapter" else method.head.auto_class
    lib = "peft" if fmt == "adapter" else "transformers"
    lines = ["import torch"]
    if fmt == "adapter":
        lines += [f"from peft import {cls}", "from transformers import AutoTokenizer"
                  + (", GenerationConfig" if method.head.generates else "")]
    else:
        lines += [f"from {lib} import AutoTokenizer, {cls}"]
    pads = "  # pads on the left" if method.head.decoder_only else ""
    lines += ["", 'folder = "."  # this export folder', f"tok = AutoTokenizer.from_pretrained(folder){pads}",
              f"model = {cls}.from_pretrained(folder).eval()"]
    if chat:  # the template the model was tuned with (chat_template.jinja), its assistant cue at the end
        lines += ["conversations = ["] + [f"    {json.dumps(c)}," for c in method.chat_examples] + ["]",
                  "batch = tok.apply_chat_template(conversations, add_generation_prompt=True, padding=True, "
                  "return_tensors=\"pt\")"]
    else:
        inputs = f"[{prefix!r} + t for t in texts]" if prefix else "texts"
        lines += [f"texts = {method.examples!r}",
                  f"batch = tok({inputs}, truncation=True, padding=True, return_tensors=\"pt\")"]
    return "\n".join(lines + method.usage_lines(fmt))


FILES = {
    "merged": "the base with the LoRA weights merged in ({dtype}{deq}): config.json, model.safetensors, "
              "generation_config.json; `{auto}.from_pretrained(folder)`",
    "adapter": "the PEFT LoRA adapter: adapter_config.json (base `{base}` at commit `{rev}`), "
               "adapter_model.safetensors; `{peft}.from_pretrained(folder)` fetches the base from the hub",
    "model": "the finetuned model ({dtype}): config.json, model.safetensors; `{auto}.from_pretrained(folder)`",
}


def card(name: str, description: str | None, sections: dict[str, Any], keys: dict[str, str], train: dict[str, Any],
         fmt: str, extra: dict[str, str], sets: list[str], facts: dict[str, Any], revision: str | None,
         evaluated: dict[str, dict[str, float]], chat: dict[str, Any] | None = None) -> str:
    """The model card; `chat`: a chat export's facts (its template file, the end-of-turn token)."""
    import yaml

    m, method = sections["model"], method_of(sections["method"]["name"])
    lines = [front_matter(name, sections, fmt, revision, evaluated) + f"# {name}", ""]
    if description:
        lines += [description, ""]
    base = f"`{m['name']}`" + (f" (hub, commit `{revision}`)" if revision else
                                " (not on a hub: the weights at the top of this folder stand alone)")
    lines += [f"Method `{method.name}`, base model {base}, adapters `{sections['adapters']['method']}`, quantization "
              f"`{sections['quantization']['mode']}`.", ""]
    if evaluated:
        lines += ["## Evaluation", "", "| split | metric | value |", "|---|---|---|"]
        lines += [f"| {s} | {k} | {round(float(v), 4)} |" for s, vals in evaluated.items() for k, v in vals.items()]
        lines += [""]
    deq = f", dequantized from {facts['dequantized_from']}" if facts.get("dequantized_from") else ""
    top = FILES[fmt].format(dtype=facts.get("dtype", "float32"), deq=deq, auto=method.head.auto_class,
                            peft=method.head.auto_peft_class, base=m["name"], rev=revision)
    lines += ["## Files", "", f"- top of the folder: {top}; tokenizer files (truncating at "
              f"{sections['tokenize']['max_length']} tokens)"]
    lines += [f"- `{k}/`: {v}" for k, v in extra.items()]
    lines += [f"- `{PIPELINE_YAML}`: this pipeline for `--config` (every in-key setting that is not a default); "
              f"`{PIPELINE_JSON}`: every in-key setting",
              "- `README.md`: this card", ""]
    names = sections["data"].get("label_names") if method.head.classifies else None
    if names:  # also the exported config's id2label / label2id
        lines += ["## Labels", "", "| id | label |", "|---|---|"] + [f"| {i} | {n} |" for i, n in enumerate(names)]
        lines += [""]
    lines += ["## Usage", ""]
    if chat:
        lines += [f"A chat model: the tokenizer's chat template (`{chat['template']}`) is the one it was tuned with; "
                  f"`generation_config.json` stops each answer at `{chat['end_of_turn']}`, the token that closes an "
                  "assistant turn; the tokenizer pads a batch on the left.", ""]
    lines += ["With torch, transformers" + (" and peft" if fmt == "adapter" else "") + " installed, from this folder:",
              "", "```python", usage_snippet(method, fmt, sections["tokenize"]["prefix"], bool(chat)), "```", ""]
    if chat:
        lines += ["Or with finetune installed, batched: `finetune predict FOLDER --chat \"a question\" "
                  "[--system \"...\"]`, or `--file conversations.jsonl --messages-column messages` (each line a "
                  "conversation ending in a user turn) `--out answers.jsonl`.", ""]
    else:
        lines += ["Or on a text file, batched: `finetune predict FOLDER --file texts.csv "
                  "--out predictions.jsonl` (with finetune installed).", ""]
    lines += ["## Reproduce", "", f"With finetune installed, in a folder that holds `{PIPELINE_YAML}`:", "",
              "```bash", command(name, sets), "```", ""]
    lines += ["The `--set` options are the ones this run was given (its runtime settings left out); they are "
              f"already folded into `{PIPELINE_YAML}`. Settings that do not change results (data.mirror, logging, "
              "devices) take their defaults. Re-evaluate from the store without retraining:", "", "```bash",
              command(name, sets, "--only", "evaluate"), "```", ""]
    lines += ["## Training metrics", "", "| metric | value |", "|---|---|"]
    # what made the weights, not how fast this machine was: a retrain that reproduces them gives the same card
    for k in ("steps", "epochs_done", "examples", "effective_batch", "precision", "optimizer", "trainable_params",
              "total_params", "first_loss", "final_loss"):
        if train.get(k) is not None:
            v = train[k]
            lines.append(f"| {k} | {round(v, 6) if isinstance(v, float) else v} |")
    for rec in train.get("validation") or []:
        shown = ", ".join(f"{k} {v}" for k, v in rec.items() if k not in ("step", "kind"))
        lines.append(f"| validation at step {rec.get('step')} | {shown} |")
    lines += [""]
    lines += ["## Stage keys", "", "| stage | key |", "|---|---|"] + [f"| {k} | `{v}` |" for k, v in keys.items()]
    lines += [""]
    lines += ["## Export", "", "```json", json.dumps(facts, indent=2, sort_keys=True), "```", ""]
    lines += ["## Config", "", "```yaml", yaml.safe_dump(sections, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- the stage


def write_formats(job: ExportJob) -> tuple[dict[str, Any], dict[str, str]]:
    """Each format export.formats lists written (hf first: the others are written from the folder it writes), and
    checked: (facts for the manifest, the top's at the top and each other's under its name; {folder: card line})."""
    facts: dict[str, Any] = {}
    extra: dict[str, str] = {}
    for export_format in listed_formats(job.cfg):
        written = export_format.write(job)
        if export_format.folder:
            facts[export_format.name] = written
        else:
            facts.update(written)
        extra.update(export_format.card_lines(job, written))
    return facts, extra


def run(ctx: StageContext) -> dict[str, Any]:
    import yaml

    cfg, out = ctx.cfg, ctx.out_dir
    method = method_of(cfg.method.name)
    fmt = top_layout(cfg)
    revision = pinned_revision(ctx) if hub_base(cfg.model) else None
    tok = save_tokenizer(ctx.upstream["tokenize"] / "tokenizer", out, cfg.tokenize, method)
    gen = generation_config(ctx.upstream["model"], cfg.evaluate, tok, method)
    facts: dict[str, Any] = {"method": cfg.adapters.method, "layout": fmt, "base_revision": revision}
    chat = chat_facts(ctx.upstream_manifests["tokenize"], tok, out)
    if chat:
        facts["chat"] = chat
    written, extra = write_formats(ExportJob(cfg, out, fmt, ctx.upstream, revision, tok, gen, ctx.log))
    facts.update(written)

    sections = config_sections(cfg)
    keys = lineage(ctx)
    sets = list(cfg.overrides)  # the run's own --set options of the sections the card shows (runtime ones dropped)
    evaluated = scores(ctx.upstream_manifests["evaluate"].get("metrics", {}))
    train_metrics = ctx.upstream_manifests["train"].get("metrics", {})
    (out / PIPELINE_JSON).write_text(json.dumps({"name": cfg.name, "description": cfg.description, **sections},
                                                indent=2, sort_keys=True))
    changed = {s: v for s in CARD_SECTIONS if (v := non_defaults(getattr(cfg, s)))}
    if cfg.data.path:  # read whatever the source (data.load_source); in this stage's key: the file must run
        changed.setdefault("data", {})["path"] = cfg.data.path
    (out / PIPELINE_YAML).write_text(f"# {cfg.name} as exported: every in-key setting that differs from the schema's "
                                     f"defaults\n# {command(cfg.name, [])}\n"
                                     + yaml.safe_dump({"pipelines": {cfg.name: {"description": cfg.description,
                                                                                **changed}}}, sort_keys=False))
    (out / "README.md").write_text(card(cfg.name, cfg.description, sections, keys, train_metrics, fmt, extra, sets,
                                        facts, revision, evaluated, chat))
    ctx.log.info("export: %s at the top%s", fmt, "".join(f", {k}/" for k in extra))
    return {**facts, "files": sorted(p.name for p in out.iterdir()), "keys": keys, "command": command(cfg.name, sets)}
