"""seq2seq: an encoder-decoder generating the target from the text (summarisation); the loss on the target
tokens; ROUGE."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from stages.methods.base import Features, MethodData, StepOutput
from stages.methods.generation import Generation
from stages.pipeline.schema import MethodConfig, TokenizeConfig
from stages.text.tokens import IGNORE_INDEX

if TYPE_CHECKING:
    import torch

    from stages.training.batching import Batch


class Seq2SeqSettings(MethodConfig):
    head: ClassVar[str] = "seq2seq"


DATA = MethodData(needs_target=True)


class Seq2Seq(Generation):
    name = "seq2seq"
    summary = "an encoder-decoder generating the target from the text (ROUGE)"
    settings = Seq2SeqSettings
    data = DATA
    examples = ["This bill amends the Internal Revenue Code to extend the tax credit for small businesses that "
                "hire veterans through 2030."]

    def with_targets(self, tok: Any, bare: list[list[int]], bare_targets: list[list[int]],
                     target_ids: list[list[int]], target_lengths: list[int], t: TokenizeConfig) -> Features:
        from stages.text.tokens import with_specials

        ids, lengths = with_specials(tok, bare, t.max_length)
        return Features({"input_ids": ids, "labels": target_ids}, lengths, target_lengths)

    def step(self, model: torch.nn.Module, batch: Batch) -> StepOutput:
        import torch.nn.functional as F

        # labels make the model build its decoder inputs (shifted right); the loss is computed here, summed
        labels = batch["labels"]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
        return StepOutput(loss, batch.units)


METHOD = Seq2Seq()
