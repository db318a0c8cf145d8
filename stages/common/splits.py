"""Row access to a tokenized split (the train stage's batches are cut from it) and the validation pass
over one."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from stages.common import metrics
from stages.common.batching import IGNORE_INDEX, Batch, collate, split_micro
from stages.common.generation import decoded_targets, generate, prompt_of, stop_token
from stages.common.losses import loss_units, summed_loss


class Rows:
    """Row access to a tokenized split (a datasets.Dataset or a list of dicts, for tests)."""

    def __init__(self, ds: Any):
        self.ds = ds
        if isinstance(ds, list):
            self.lengths = [len(r["input_ids"]) for r in ds]
        else:
            cols = ds.column_names
            self.lengths = list(ds["length"]) if "length" in cols else [len(x) for x in ds["input_ids"]]

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, idx: list[int]) -> list[dict]:
        if isinstance(self.ds, list):
            return [self.ds[i] for i in idx]
        cols = self.ds[idx]
        return [{"input_ids": cols["input_ids"][j], "labels": cols["labels"][j]} for j in range(len(idx))]

    def batches(self, idx: list[int], micro: int, pad_id: int, task: str) -> list[Batch]:
        return [collate(self.get(mb), pad_id, task) for mb in split_micro(idx, self.lengths, micro)]


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
