"""classify: a classification head on the model, cross-entropy over the classes; accuracy, macro-F1 and a
confusion matrix."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from stages.methods import metrics
from stages.methods.base import Features, Method, MethodData, StepOutput
from stages.pipeline.schema import MethodConfig, TokenizeConfig

if TYPE_CHECKING:
    import torch

    from stages.training.batching import Batch, Rows


class ClassifySettings(MethodConfig):
    head: ClassVar[str] = "seq_cls"


DATA = MethodData(classifies=True, source_target=False)


class Classify(Method):
    name = "classify"
    summary = "a classification head on the model (accuracy, macro-F1)"
    settings = ClassifySettings
    data = DATA
    predicts = "labels"
    default_metrics = ("accuracy", "f1")
    validation_metrics = ("loss", "accuracy", "macro_f1")
    examples = ["A wonderful, moving film with a great cast.", "Dull, predictable and far too long."]

    def token_features(self, tok: Any, bare: list[list[int]], table: Any, t: TokenizeConfig, desc: str) -> Features:
        from stages.text.tokens import with_specials

        ids, lengths = with_specials(tok, bare, t.max_length)
        return Features({"input_ids": ids, "labels": table.column("label").to_pylist()}, lengths)

    def label_tensor(self, rows: list[dict]) -> torch.Tensor:
        import torch

        return torch.as_tensor([int(r["labels"]) for r in rows], dtype=torch.long)

    def loss_units(self, tensors: dict[str, torch.Tensor]) -> int:
        return int(tensors["labels"].shape[0])

    def step(self, model: torch.nn.Module, batch: Batch) -> StepOutput:
        import torch.nn.functional as F

        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return StepOutput(F.cross_entropy(logits.float(), batch["labels"], reduction="sum"), batch.units)

    def validation_pass(self, model: torch.nn.Module, rows: Rows, order: list[int], pad_id: int, batch_size: int,
                        device: torch.device, module: str | None, tok: Any) -> dict[str, float]:
        import torch.nn.functional as F

        loss_sum, correct = 0.0, 0
        preds: list[int] = []
        refs: list[int] = []
        for i in range(0, len(order), batch_size):
            b = self.collate(rows.get(order[i:i + batch_size]), pad_id).to(device)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
            loss_sum += float(F.cross_entropy(logits, b["labels"], reduction="sum"))
            correct += int((logits.argmax(-1) == b["labels"]).sum())
            preds += logits.argmax(-1).tolist()
            refs += b["labels"].tolist()
        out = {"val_loss": round(loss_sum / max(len(rows), 1), 6),
               "val_accuracy": round(correct / max(len(rows), 1), 6)}
        if module is not None:
            out.update({f"val_{k}": round(v, 6) for k, v in metrics.compute([module], preds, refs).items()})
        return out

    def generation(self, e: Any, tok: Any, model: Any) -> dict[str, Any]:
        return {}

    def evaluate(self, model: torch.nn.Module, rows: dict[str, list], *, tok: Any, gen: dict[str, Any],
                 scores: list[str], batch_size: int, device: torch.device, desc: str, log: logging.Logger,
                 targets: Callable[[], list[str] | None]) -> tuple[dict[str, Any], list[Any] | None, list[Any]]:
        from stages.models.inference import class_logits

        refs = [int(x) for x in rows["labels"]]
        logits = class_logits(model, rows["input_ids"], tok.pad_token_id, batch_size, device, desc, log)
        preds = [int(p) for p in logits.argmax(-1).tolist()]
        num_labels = int(model.config.num_labels)  # type: ignore[union-attr,arg-type]  # a classifier's, set
        return metrics.classification_metrics(preds, refs, num_labels, scores), preds, refs

    def predict(self, model: Any, tok: Any, generation: dict[str, Any], ids: list[list[int]], batch_size: int,
                overrides: dict[str, Any] | None, device: Any, log: logging.Logger) -> list[dict[str, Any]]:
        from stages.models.inference import class_logits

        probs = class_logits(model, ids, tok.pad_token_id, batch_size, device, "predict", log).softmax(-1)
        names = [model.config.id2label[i] for i in range(probs.shape[-1])]
        out = []
        for p in probs.tolist():
            best = max(range(len(p)), key=p.__getitem__)
            out.append({"label": names[best], "probability": round(p[best], 6),
                        "probabilities": {n: round(v, 6) for n, v in zip(names, p, strict=True)}})
        return out

    def usage_lines(self, fmt: str) -> list[str]:
        return ["with torch.no_grad():", "    probs = model(**batch).logits.softmax(-1)",
                "for text, p in zip(texts, probs):",
                "    print(model.config.id2label[int(p.argmax())], round(float(p.max()), 3), text)"]


METHOD = Classify()
