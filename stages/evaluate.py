"""Evaluate stage: the trained model on the configured split(s).

    classification (seq_cls)  logits -> argmax: accuracy, macro-F1, confusion matrix [true][predicted]
    summarisation (seq2seq)   batched generation (greedy or beams, max_new_tokens, length_penalty from
                              the `evaluate` section) -> ROUGE-1/2/L/Lsum with stemming
    causal_lm                 with a target: generation after the prompt -> ROUGE; without: perplexity

each computed by the task's object (stages/common/tasks.py: Task.evaluate).

The scores come from the `evaluate` modules `evaluate.metrics` names (default: the task's; the project's
offline accuracy / f1 / rouge modules, stages/common/metrics.py); the confusion matrix is computed here.

References for ROUGE are the data stage's target texts (untruncated, original case), not the tokenized
labels. Rows are batched longest first (little padding; an out-of-memory error shows on the first batch) by
stages/common/inference.py, which `flows.predict` shares; predictions are written in split order.

Artifact: `metrics.json` ({split: metrics}) and `predictions.jsonl` (one line per example: split, id,
prediction, reference; a classifier's as class names when the data names them, with prediction_id and
reference_id). `evaluate.baseline` also evaluates the untuned model (LoRA: adapters disabled; a full
finetune: the model stage's weights) on the same rows with the same settings: metrics.json's `baseline`
({split: metrics}), each prediction's `baseline` field. The `evaluate` section is its own config section, so changing it reruns only
this stage; `--only evaluate` / `--force evaluate` run it alone from the store.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.common import metrics
from stages.common.arrow import read_split
from stages.common.compat.bitsandbytes import exact_cpu_kernels
from stages.common.device import autocast, resolve_precision
from stages.common.hf import load_tokenizer
from stages.common.inference import device_for
from stages.common.model_loading import load_model, load_trained
from stages.common.tasks import task_of
from stages.engine.errors import MissingInputError
from stages.engine.stage import StageContext

if TYPE_CHECKING:
    from stages.common.model_loading import HFModel


log = logging.getLogger("finetune.evaluate")  # the stage's logger (StageContext.log): progress lines


def load_evaluated(model_dir: Path, adapters_dir: Path, train_dir: Path) -> HFModel:
    """The model this stage evaluates (eval mode): the trained model, fp32 on CPU."""

    model = load_trained(model_dir, adapters_dir, train_dir)
    exact_cpu_kernels(model)
    return model


# ---------------------------------------------------------------- the stage


def references(data_dir: Path, split: str, ids: list[str]) -> list[str] | None:
    """The data stage's target texts for these rows (tokenize keeps row order), or None without targets."""

    table = read_split(data_dir, split)
    if "target" not in table.column_names:
        return None
    data_ids = table.column("id").to_pylist()[:len(ids)]
    if [str(x) for x in data_ids] != [str(x) for x in ids]:
        raise MissingInputError(f"evaluate: the tokenize and data artifacts of split {split} disagree on row ids; "
                                f"rerun with --force tokenize")
    return table.column("target").to_pylist()[:len(ids)]


def prediction_record(split: str, row_id: str, prediction: Any, reference: Any,
                      names: list[str] | None) -> dict[str, Any]:
    """One line of predictions.jsonl; a classifier's ids become class names when the data names them."""
    if names is None:
        return {"split": split, "id": row_id, "prediction": prediction, "reference": reference}
    return {"split": split, "id": row_id, "prediction": names[prediction], "reference": names[reference],
            "prediction_id": prediction, "reference_id": reference}


@contextlib.contextmanager
def untuned(lora: HFModel | None, model_dir: Path) -> Iterator[HFModel]:
    """The model before tuning, for evaluate.baseline: the trained LoRA model `lora` with its adapters
    disabled (PEFT's disable_adapter, modules_to_save included); without one (a full finetune), the model
    stage's weights loaded anew."""
    if lora is not None:
        with lora.disable_adapter():  # type: ignore[operator]  # a PeftModel's
            yield lora
        return
    base = load_model(model_dir).eval()
    exact_cpu_kernels(base)
    yield base


def evaluate_splits(model: HFModel, ctx: StageContext, ds: Any, tok: Any, gen: dict[str, Any], device: Any,
                    what: str = "") -> tuple[dict[str, Any], dict[str, tuple[list[str], list[Any], list[Any]]]]:
    """({split: metrics}, {split: (ids, predictions, references)}) of the model on evaluate.splits; a split
    without predictions (perplexity) has metrics only."""
    e, task = ctx.cfg.evaluate, task_of(ctx.cfg.model.task)
    scores = metrics.metric_names(e.metrics, task)
    results: dict[str, Any] = {}
    predicted: dict[str, tuple[list[str], list[Any], list[Any]]] = {}
    for split in e.splits:
        part = ds[split]
        if e.max_examples:
            part = part.select(range(min(e.max_examples, len(part))))
        rows = part.to_dict()
        ids = [str(x) for x in rows["id"]]
        results[split], preds, refs = task.evaluate(
            model, rows, tok=tok, gen=gen, scores=scores, batch_size=e.batch_size, device=device,
            desc=f"evaluate {what}{split}", log=log,
            targets=functools.partial(references, ctx.upstream["data"], split, ids))
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in results[split].items()
                 if k != "confusion_matrix"}
        ctx.log.info("evaluate %s%s: %s", what, split, shown)
        if preds is not None:  # nothing predicted (a causal LM without targets: perplexity)
            predicted[split] = (ids, preds, refs)
    return results, predicted


def run(ctx: StageContext) -> dict[str, Any]:
    import datasets

    e, task = ctx.cfg.evaluate, task_of(ctx.cfg.model.task)
    tok_dir = ctx.upstream["tokenize"]
    ds = datasets.load_from_disk(str(tok_dir / "dataset"))
    missing = [s for s in e.splits if s not in ds]
    if missing:
        raise MissingInputError(f"evaluate.splits {missing}: the data has no such split (it has "
                                f"{', '.join(ds)}); set evaluate.splits to some of those")
    tok = load_tokenizer(tok_dir / "tokenizer")
    model = load_evaluated(ctx.upstream["model"], ctx.upstream["adapters"], ctx.upstream["train"])
    device = device_for(model)
    precision = resolve_precision(ctx.cfg.train.mixed_precision, device)  # training's, resolved at plan
    ctx.log.info("evaluate: device %s, precision %s (%s)", device, precision.name, precision.reason)
    gen = task.generation(e, tok, model)
    names = ctx.upstream_manifests["data"].get("metrics", {}).get("label_names")  # seq_cls: id -> class name

    baseline: dict[str, Any] = {}
    base_preds: dict[str, tuple[list[str], list[Any], list[Any]]] = {}
    with autocast(precision, device):
        results, predicted = evaluate_splits(model, ctx, ds, tok, gen, device)
        if e.baseline:
            lora = model if hasattr(model, "peft_config") else None
            del model  # a full finetune's tuned weights: not kept beside the untuned ones
            with untuned(lora, ctx.upstream["model"]) as base:
                baseline, base_preds = evaluate_splits(base, ctx, ds, tok, gen, device, "baseline ")
    with open(ctx.out_dir / "predictions.jsonl", "w") as out:
        for split, (ids, preds, refs) in predicted.items():
            untuned_preds = base_preds[split][1] if split in base_preds else None
            for j, (i, p, r) in enumerate(zip(ids, preds, refs, strict=True)):
                rec = prediction_record(split, i, p, r, names)
                if untuned_preds is not None:
                    rec["baseline"] = names[untuned_preds[j]] if names is not None else untuned_preds[j]
                out.write(json.dumps(rec) + "\n")
                if j < e.log_examples:
                    ctx.log.info("  %s: predicted %r, reference %r", i, str(rec["prediction"])[:200],
                                 str(rec["reference"])[:200])
    (ctx.out_dir / "metrics.json").write_text(json.dumps({**results, **({"baseline": baseline} if baseline else {})},
                                                         indent=2, sort_keys=True))
    return {"task": task.name, "splits": results, **({"baseline": baseline} if baseline else {}),
            **({"label_names": names} if names else {}),
            "precision": precision.name, "precision_reason": precision.reason,
            "generation": {k: v for k, v in gen.items() if k not in ("eos_token_id", "pad_token_id")}}
