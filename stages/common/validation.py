"""The validation pass over a tokenized split: its rows, and the mean loss (and accuracy) over them."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from stages.common import metrics
from stages.common.batching import IGNORE_INDEX, Rows, collate
from stages.common.inference import decoded_targets, generate, prompt_of, stop_token
from stages.common.losses import loss_units, summed_loss


def validation_rows(val_ds: Any, max_examples: int | None) -> Rows | None:
    """The validation split's rows (its first `max_examples`), None when there are none."""
    if val_ds is None or not len(val_ds):
        return None
    if max_examples is not None and max_examples < len(val_ds):
        val_ds = val_ds[:max_examples] if isinstance(val_ds, list) else val_ds.select(range(max_examples))
    return Rows(val_ds)


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, rows: Rows, task: str, pad_id: int, batch_size: int,
                  device: torch.device, metric: str | None = None, tokenizer: Any = None) -> dict[str, float]:
    """Validation: mean loss (per row or per target token) and, for classification, accuracy; both
    accumulated as counts batch by batch (memory does not grow with the split). `metric` (select_best's,
    e.g. val_macro_f1, val_rougeL) adds the scores of the evaluate stage's module for it: classification
    from the predicted classes, ROUGE from greedy generation of the rows' targets (needs `tokenizer`)."""
    was_training = model.training
    model.eval()
    loss_sum, units, correct = 0.0, 0, 0
    preds: list[int] = []
    refs: list[int] = []
    order = sorted(range(len(rows)), key=lambda i: rows.lengths[i])
    for i in range(0, len(order), batch_size):
        b = collate(rows.get(order[i:i + batch_size]), pad_id, task).to(device)
        if task == "seq_cls":
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()
            loss_sum += float(F.cross_entropy(logits, b.labels, reduction="sum"))
            correct += int((logits.argmax(-1) == b.labels).sum())
            preds += logits.argmax(-1).tolist()
            refs += b.labels.tolist()
        else:
            loss_sum += float(summed_loss(model, b, task))
        units += loss_units(b, task)
    out = {"val_loss": round(loss_sum / max(units, 1), 6)}
    if task == "seq_cls":
        out["val_accuracy"] = round(correct / max(len(rows), 1), 6)
    module = metrics.VALIDATION_MODULES.get((metric or "").removeprefix("val_"))
    if module is not None and task == "seq_cls":
        out.update({f"val_{k}": round(v, 6) for k, v in metrics.compute([module], preds, refs).items()})
    elif module is not None:
        out.update({f"val_{k}": round(v, 6) for k, v in
                    validation_generation_scores(model, rows, task, tokenizer, batch_size, device, module).items()})
    model.train(was_training)
    return out


def validation_generation_scores(model: torch.nn.Module, rows: Rows, task: str, tok: Any, batch_size: int,
                                 device: torch.device, module: str) -> dict[str, float]:
    """Greedy generation of each row's target (as many new tokens as its longest target) scored by `module`
    against the decoded targets."""
    if tok is None:
        raise ValueError("validation by generation needs the tokenizer")
    got = rows.get(list(range(len(rows))))
    labels = [list(r["labels"]) for r in got]
    prompts = [list(r["input_ids"]) if task == "seq2seq" else prompt_of(list(r["input_ids"]), y)
               for r, y in zip(got, labels, strict=True)]
    refs = decoded_targets(tok, labels)
    longest = max((sum(t != IGNORE_INDEX for t in y) for y in labels), default=1)
    gen = {"max_new_tokens": max(longest, 1), "num_beams": 1, "do_sample": False,
           "eos_token_id": stop_token(tok, model), "pad_token_id": tok.pad_token_id}
    texts, _ = generate(model, prompts, tok, gen, batch_size, device, task == "causal_lm", "validation")
    return {k: float(v) for k, v in metrics.compute([module], texts, refs).items()}
