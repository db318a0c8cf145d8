"""Evaluate stage: the trained model on the configured split(s).

    classification (seq_cls)  logits -> argmax: accuracy, macro-F1, confusion matrix [true][predicted]
    summarisation (seq2seq)   batched generation (greedy or beams, max_new_tokens, length_penalty from
                              the `evaluate` section) -> ROUGE-1/2/L/Lsum with stemming
    causal_lm                 with a target: generation after the prompt -> ROUGE; without: perplexity

each computed by the pipeline's method (stages/methods/: Method.evaluate).

The scores come from the `evaluate` modules `evaluate.metrics` names (default: the method's; the project's
offline accuracy / f1 / rouge modules, stages/methods/metrics.py); the confusion matrix is computed here.

References for ROUGE are the data stage's target texts (untruncated, original case), not the tokenized
labels. Rows are batched longest first (little padding; an out-of-memory error shows on the first batch) by
stages/models/inference.py, which `flows.predict` shares; predictions are written in split order.

Artifact: `metrics.json` ({split: metrics}) and `predictions.jsonl` (one line per example: split, id,
prediction, reference; a classifier's as class names when the data names them, with prediction_id and
reference_id). The `evaluate` section is its own config section, so changing it reruns only
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

from stages.engine.errors import MissingInputError
from stages.engine.stage import StageContext
from stages.methods import metrics
from stages.methods.base import Method
from stages.methods.registry import method_in
from stages.models.compat.bitsandbytes import exact_cpu_kernels
from stages.models.hf import load_tokenizer
from stages.models.inference import device_for
from stages.models.model_loading import load_model, load_trained
from stages.pipeline.schema import EvaluateConfig
from stages.sources.arrow import read_split
from stages.training.device import autocast, resolve_precision

if TYPE_CHECKING:
    from stages.models.model_loading import HFModel


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
def untuned(model: HFModel, model_dir: Path) -> Iterator[HFModel]:
    """The model before training (evaluate.baseline): LoRA's adapters switched off (their new heads and
    modules_to_save as initialised), or a full finetune's base as the model stage saved it."""
    if hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            yield model
    else:
        base = load_model(model_dir).eval()
        exact_cpu_kernels(base)
        yield base


def evaluate_splits(model: HFModel, ds: Any, *, tok: Any, gen: dict[str, Any], scores: list[str], e: EvaluateConfig,
                    names: list[str] | None, method: Method, device: Any, data_dir: Path, out: Path, label: str,
                    logger: logging.Logger) -> dict[str, Any]:
    """{split: metrics} of `model` on evaluate.splits, its predictions written to `out` (one line each)."""
    results: dict[str, Any] = {}
    with open(out, "w") as f:
        for split in e.splits:
            part = ds[split]
            if e.max_examples:
                part = part.select(range(min(e.max_examples, len(part))))
            rows = part.to_dict()
            ids = [str(x) for x in rows["id"]]
            results[split], preds, refs = method.evaluate(
                model, rows, tok=tok, gen=gen, scores=scores, batch_size=e.batch_size, device=device,
                desc=f"{label} {split}", log=log, targets=functools.partial(references, data_dir, split, ids))
            if preds is None:  # nothing predicted (a causal LM without targets: perplexity)
                continue
            for i, p, r in zip(ids, preds, refs, strict=True):
                f.write(json.dumps(prediction_record(split, i, p, r, names)) + "\n")
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in results[split].items()
                     if k != "confusion_matrix"}
            logger.info("%s %s: %s", label, split, shown)
            for i, p, r in list(zip(ids, preds, refs, strict=True))[:e.log_examples]:
                rec = prediction_record(split, i, p, r, names)
                logger.info("  %s: predicted %r, reference %r", i, str(rec["prediction"])[:200],
                            str(rec["reference"])[:200])
    return results


def run(ctx: StageContext) -> dict[str, Any]:
    import datasets

    e, method = ctx.cfg.evaluate, method_in(ctx.cfg)
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
    gen = method.generation(e, tok, model)
    scores = metrics.metric_names(e.metrics, method)
    names = ctx.upstream_manifests["data"].get("metrics", {}).get("label_names")  # seq_cls: id -> class name

    def evaluated(which: Any, file: str, label: str) -> dict[str, Any]:
        return evaluate_splits(which, ds, tok=tok, gen=gen, scores=scores, e=e, names=names, method=method,
                               device=device, data_dir=ctx.upstream["data"], out=ctx.out_dir / file,
                               label=label, logger=ctx.log)

    with autocast(precision, device):
        results = evaluated(model, "predictions.jsonl", "evaluate")
        baseline = None
        if e.baseline:  # the untuned model on the same rows, with the same settings
            with untuned(model, ctx.upstream["model"]) as base:
                baseline = evaluated(base, "baseline_predictions.jsonl", "baseline")
    (ctx.out_dir / "metrics.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    if baseline is not None:
        (ctx.out_dir / "baseline_metrics.json").write_text(json.dumps(baseline, indent=2, sort_keys=True))
    extra = {"baseline": baseline} if baseline is not None else {}
    return {"method": method.name, "splits": results, **extra, **({"label_names": names} if names else {}),
            "precision": precision.name, "precision_reason": precision.reason,
            "generation": {k: v for k, v in gen.items() if k not in ("eos_token_id", "pad_token_id")}}
