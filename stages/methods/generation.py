"""What the generating methods (seq2seq, sft) share: the loss on target tokens, ROUGE on greedy or beam
generation, generated answers for `finetune predict`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stages.engine.errors import MissingInputError
from stages.methods import metrics
from stages.methods.base import Features, Method
from stages.pipeline.schema import TokenizeConfig
from stages.text.tokens import IGNORE_INDEX

if TYPE_CHECKING:
    import torch

    from stages.training.batching import Rows


class Generation(Method):
    predicts = "texts"
    default_metrics = ("rouge",)
    validation_metrics = ("loss", "rouge1", "rouge2", "rougeL", "rougeLsum", "exact_match")

    def token_features(self, tok: Any, bare: list[list[int]], table: Any, t: TokenizeConfig, desc: str) -> Features:
        from stages.text.tokens import bare_ids, with_specials

        if "target" not in table.column_names:  # language modelling: every token is a label
            ids, lengths = with_specials(tok, bare, t.max_length)
            return Features({"input_ids": ids, "labels": ids}, lengths)
        bare_targets = bare_ids(tok, table.column("target").to_pylist(), t.batch_size, f"{desc} targets")
        target_ids, target_lengths = with_specials(tok, bare_targets, t.max_target_length)
        return self.with_targets(tok, bare, bare_targets, target_ids, target_lengths, t)

    def with_targets(self, tok: Any, bare: list[list[int]], bare_targets: list[list[int]],
                     target_ids: list[list[int]], target_lengths: list[int], t: TokenizeConfig) -> Features:
        """Features with targets, given the texts' and targets' bare ids and the targets with their specials."""
        raise NotImplementedError

    def prompts(self, input_ids: list[list[int]], labels: list[list[int]],
                starts: list[int] | None = None) -> list[list[int]]:
        """What generation starts from, for tokenized rows (`starts`: their prompt_length column)."""
        return [list(x) for x in input_ids]

    def validation_pass(self, model: torch.nn.Module, rows: Rows, order: list[int], pad_id: int, batch_size: int,
                        device: torch.device, module: str | None, tok: Any) -> dict[str, float]:
        loss_sum, units = self.summed_over(model, rows, order, pad_id, batch_size, device)
        out = {"val_loss": round(loss_sum / max(units, 1), 6)}
        if module is not None:
            out.update({f"val_{k}": round(v, 6) for k, v in
                        self.generation_scores(model, rows, tok, batch_size, device, module).items()})
        return out

    def generation_scores(self, model: torch.nn.Module, rows: Rows, tok: Any, batch_size: int,
                          device: torch.device, module: str) -> dict[str, float]:
        """Greedy generation of each row's target (as many new tokens as its longest target) scored by
        `module` against the decoded targets."""
        from stages.models.inference import decoded_targets, generate, stop_token

        if tok is None:
            raise ValueError("validation by generation needs the tokenizer")
        got = rows.get(list(range(len(rows))))
        labels = [list(r["labels"]) for r in got]
        prompts = self.prompts([list(r["input_ids"]) for r in got], labels)
        refs = decoded_targets(tok, labels)
        longest = max((sum(t != IGNORE_INDEX for t in y) for y in labels), default=1)
        gen = {"max_new_tokens": max(longest, 1), "num_beams": 1, "do_sample": False,
               "eos_token_id": stop_token(tok, model), "pad_token_id": tok.pad_token_id}
        texts, _ = generate(model, prompts, tok, gen, batch_size, device, self.head.decoder_only, "validation")
        return {k: float(v) for k, v in metrics.compute([module], texts, refs).items()}

    def evaluate(self, model: torch.nn.Module, rows: dict[str, list], *, tok: Any, gen: dict[str, Any],
                 scores: list[str], batch_size: int, device: torch.device, desc: str, log: logging.Logger,
                 targets: Callable[[], list[str] | None]) -> tuple[dict[str, Any], list[Any] | None, list[Any]]:
        from stages.models.inference import generate

        refs = targets()
        if refs is None:
            return self.untargeted(model, rows, tok, batch_size, device, desc, log), None, []
        prompts = self.prompts(rows["input_ids"], rows["labels"], rows.get("prompt_length"))
        preds, counts = generate(model, prompts, tok, gen, batch_size, device, self.head.decoder_only, desc, log)
        return ({"examples": len(refs), **metrics.compute(scores, preds, refs),
                 "generated_tokens_mean": sum(counts) / max(len(counts), 1),
                 "generated_tokens_max": max(counts, default=0)}, preds, refs)

    def untargeted(self, model: torch.nn.Module, rows: dict[str, list], tok: Any, batch_size: int,
                   device: torch.device, desc: str, log: logging.Logger) -> dict[str, Any]:
        """What a split without target texts evaluates to."""
        raise MissingInputError(f"{desc}: the data has no target texts for ROUGE; set data.target_column")

    def predict(self, model: Any, tok: Any, generation: dict[str, Any], ids: list[list[int]], batch_size: int,
                overrides: dict[str, Any] | None, device: Any, log: logging.Logger) -> list[dict[str, Any]]:
        import copy

        from stages.models.inference import generate

        gen = copy.deepcopy(generation["generation_config"])
        gen.update(**(overrides or {}))
        texts, counts = generate(model, ids, tok, {"generation_config": gen, "eos_token_id": gen.eos_token_id},
                                 batch_size, device, self.head.decoder_only, "predict", log)
        return [{"generated": t, "generated_tokens": n} for t, n in zip(texts, counts, strict=True)]

    def usage_lines(self, fmt: str) -> list[str]:
        gen = ", generation_config=GenerationConfig.from_pretrained(folder)" if fmt == "adapter" else ""
        lines = ["with torch.no_grad():  # generation_config.json: the evaluate stage's settings",
                 f"    out = model.generate(**batch{gen})"]
        if self.head.decoder_only:
            lines += ["out = out[:, batch[\"input_ids\"].shape[1]:]  # the continuation only"]
        return lines + ["for text in tok.batch_decode(out, skip_special_tokens=True):", "    print(text.strip())"]
