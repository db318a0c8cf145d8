"""A Bradley-Terry reward model, written as a user writes a method of their own: one file, named from a
pipeline file (`method: {name: path/to/bradley_terry.py:BradleyTerry}`), no file of the project edited.

Pairs of texts come in (the data's `chosen` and `rejected` columns); the model gets a scalar head (one
logit); the loss is the pairwise -log sigmoid(r_chosen - r_rejected - margin), summed over pairs; validation and
evaluation report pairwise accuracy (the chosen text scored higher) and the mean margin."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field

from stages.methods.base import Features, Method, MethodData, StepOutput
from stages.pipeline.schema import MethodConfig
from stages.training.batching import Batch, pad_tokens


class BradleyTerrySettings(MethodConfig):
    head: ClassVar[str] = "seq_cls"
    margin: float = Field(0.0, ge=0, description="the reward gap below which a pair still costs loss")


DATA = MethodData(text=False, columns=("chosen", "rejected"), source_target=False)


class BradleyTerry(Method):
    name = "bradley_terry"
    summary = "a reward model: a scalar head trained on pairs (pairwise accuracy)"
    settings = BradleyTerrySettings
    data = DATA
    predicts = "labels"
    default_metrics = ("accuracy",)
    validation_metrics = ("loss", "pairwise_accuracy")
    examples = ["A wonderful, moving film with a great cast.", "Dull, predictable and far too long."]

    def configure(self, config: Any, m: Any) -> None:
        config.num_labels = 1  # one reward per text

    def features(self, tok: Any, table: Any, t: Any, desc: str, model: str) -> Features:
        from stages.text.tokens import bare_ids, with_specials

        sides = {}
        for side in ("chosen", "rejected"):
            bare = bare_ids(tok, [t.prefix + x for x in table.column(side).to_pylist()], t.batch_size, desc)
            sides[side] = with_specials(tok, bare, t.max_length)
        (chosen, c_len), (rejected, r_len) = sides["chosen"], sides["rejected"]
        return Features({"input_ids": chosen, "rejected_ids": rejected},
                        [max(a, b) for a, b in zip(c_len, r_len, strict=True)])

    def collate(self, rows: list[dict], pad_id: int) -> Batch:
        chosen, real_c, padded_c = pad_tokens(rows, pad_id, "input_ids")
        rejected, real_r, padded_r = pad_tokens(rows, pad_id, "rejected_ids")
        tensors = {"chosen_ids": chosen["input_ids"], "chosen_mask": chosen["attention_mask"],
                   "rejected_ids": rejected["input_ids"], "rejected_mask": rejected["attention_mask"]}
        return Batch(tensors, len(rows), real_c + real_r, padded_c + padded_r)

    def rewards(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        r_c = model(input_ids=batch["chosen_ids"], attention_mask=batch["chosen_mask"]).logits.float()[:, 0]
        r_r = model(input_ids=batch["rejected_ids"], attention_mask=batch["rejected_mask"]).logits.float()[:, 0]
        return r_c, r_r

    def step(self, model: torch.nn.Module, batch: Batch) -> StepOutput:
        r_c, r_r = self.rewards(model, batch)
        gap = r_c - r_r
        loss = -torch.nn.functional.logsigmoid(gap - self.s.margin).sum()
        return StepOutput(loss, batch.units, {"pairwise_accuracy": float((gap > 0).sum()),
                                              "margin": float(gap.detach().sum())})

    def validation_pass(self, model: torch.nn.Module, rows: Any, order: list[int], pad_id: int, batch_size: int,
                        device: torch.device, module: str | None, tok: Any) -> dict[str, float]:
        loss = right = 0.0
        for i in range(0, len(order), batch_size):
            out = self.step(model, self.collate(rows.get(order[i:i + batch_size]), pad_id).to(device))
            loss += float(out.loss_sum)
            right += out.stats["pairwise_accuracy"]
        return {"val_loss": round(loss / max(len(rows), 1), 6),
                "val_pairwise_accuracy": round(right / max(len(rows), 1), 6)}

    def generation(self, e: Any, tok: Any, model: Any) -> dict[str, Any]:
        return {}

    def evaluate(self, model: torch.nn.Module, rows: dict[str, list], *, tok: Any, gen: dict[str, Any],
                 scores: list[str], batch_size: int, device: torch.device, desc: str, log: Any,
                 targets: Any) -> tuple[dict[str, Any], list[Any] | None, list[Any]]:
        from stages.methods import metrics

        pairs = [{"input_ids": a, "rejected_ids": b} for a, b in zip(rows["input_ids"], rows["rejected_ids"],
                                                                      strict=True)]
        preds, gaps = [], []
        with torch.no_grad():
            for i in range(0, len(pairs), batch_size):
                r_c, r_r = self.rewards(model, self.collate(pairs[i:i + batch_size], tok.pad_token_id).to(device))
                gaps += (r_c - r_r).tolist()
        preds = [int(g > 0) for g in gaps]
        refs = [1] * len(preds)  # the chosen text is the better one
        return ({"examples": len(preds), "pairwise_accuracy": sum(preds) / max(len(preds), 1),
                 "margin": sum(gaps) / max(len(gaps), 1), **metrics.compute(scores, preds, refs)}, preds, refs)

    def predict(self, model: Any, tok: Any, generation: dict[str, Any], ids: list[list[int]], batch_size: int,
                overrides: Any, device: Any, log: Any) -> list[dict[str, Any]]:
        from stages.models.inference import class_logits

        scores = class_logits(model, ids, tok.pad_token_id, batch_size, device, "predict", log)[:, 0]
        return [{"reward": round(float(s), 6)} for s in scores]

    def usage_lines(self, fmt: str) -> list[str]:
        return ["with torch.no_grad():", "    rewards = model(**batch).logits[:, 0]",
                "for text, r in zip(texts, rewards):", "    print(round(float(r), 3), text)"]
