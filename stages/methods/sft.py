"""sft: a decoder continuing prompt + target, the loss on the target tokens only (ROUGE); conversations
rendered with the model's chat template, the loss on the assistant's turns; without targets, plain language
modelling (perplexity). Its train rows may be packed (tokenize.packing)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

from stages.methods.base import Features, MethodData, StepOutput
from stages.methods.generation import Generation
from stages.pipeline.schema import MethodConfig, TokenizeConfig
from stages.text.tokens import IGNORE_INDEX

if TYPE_CHECKING:
    import torch

    from stages.training.batching import Batch


class SFTSettings(MethodConfig):
    head: ClassVar[str] = "causal_lm"


DATA = MethodData(chats=True)  # a target when there is one (prompt -> completion), else language modelling


class SFT(Generation):
    name = "sft"
    summary = "a decoder continuing prompt + target or a conversation, the loss on the answer (ROUGE, perplexity)"
    settings = SFTSettings
    data = DATA
    examples = ["Once upon a time", "The three things to remember when you cook pasta for a crowd are"]
    chat_examples = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Answer in one sentence."},
                      {"role": "user", "content": "Why is the sky blue on a clear day, and red at sunset?"}]]
    packs = True

    def features(self, tok: Any, table: Any, t: TokenizeConfig, desc: str, model: str) -> Features:
        """Conversations (data.format messages / alpaca) rendered with the chat template, else prompt + target."""
        if "messages" not in table.column_names:
            return super().features(tok, table, t, desc, model)
        from stages.text import chat

        template = chat.template_of(tok, t, model)
        ids, labels, lengths, starts = chat.render_rows(tok, template, table.column("messages").to_pylist(), t)
        return Features({"input_ids": ids, "labels": labels, "prompt_length": starts}, lengths, template=template)

    def with_targets(self, tok: Any, bare: list[list[int]], bare_targets: list[list[int]],
                     target_ids: list[list[int]], target_lengths: list[int], t: TokenizeConfig) -> Features:
        from stages.text.tokens import prompt_then_target, with_specials

        prompts, _ = with_specials(tok, bare, None)  # untruncated: prompt_then_target cuts the prompt's head
        ids, labels, lengths, starts = prompt_then_target(tok, prompts, bare_targets, t)  # tokenized once
        return Features({"input_ids": ids, "labels": labels, "prompt_length": starts}, lengths, target_lengths)

    def loss_units(self, tensors: dict[str, torch.Tensor]) -> int:
        return int((tensors["labels"][:, 1:] != IGNORE_INDEX).sum())

    def step(self, model: torch.nn.Module, batch: Batch) -> StepOutput:
        import torch.nn.functional as F

        # token t predicts token t+1. Packed rows (stages/text/packing.py): their position ids and no
        # attention mask, from which transformers builds a block-diagonal causal mask (only without a cache)
        position_ids = batch.get("position_ids")
        if position_ids is None:
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        else:
            out = model(input_ids=batch["input_ids"], position_ids=position_ids, use_cache=False)
        logits = out.logits[:, :-1]
        targets = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
        return StepOutput(loss, batch.units)

    def prompts(self, input_ids: list[list[int]], labels: list[list[int]],
                starts: list[int] | None = None) -> list[list[int]]:
        from stages.models.inference import prompt_of

        if starts is not None:
            return [list(x)[:n] for x, n in zip(input_ids, starts, strict=True)]
        return [prompt_of(list(x), list(y)) for x, y in zip(input_ids, labels, strict=True)]

    def untargeted(self, model: torch.nn.Module, rows: dict[str, list], tok: Any, batch_size: int,
                   device: torch.device, desc: str, log: logging.Logger) -> dict[str, Any]:
        import torch

        from stages.models.inference import batches

        total, units = 0.0, 0
        lengths = [len(x) for x in rows["input_ids"]]
        for idx in batches(lengths, batch_size, desc, log):
            b = self.collate([{"input_ids": rows["input_ids"][j], "labels": rows["labels"][j]} for j in idx],
                             tok.pad_token_id).to(device)
            out = self.step(model, b)
            total += float(out.loss_sum)
            units += out.units
        loss = total / max(units, 1)
        return {"examples": len(lengths), "loss": loss, "perplexity": float(torch.tensor(loss).exp()),
                "tokens": units}

    def generation(self, e: Any, tok: Any, model: Any) -> dict[str, Any]:
        """Also stopping at the token that closes an assistant turn under the chat template (what the tokenize
        stage labels in conversations), when it is not the end token already."""
        from stages.models.inference import end_of_turn, generation_kwargs

        kw = generation_kwargs(e, tok, model)
        eot, eos = end_of_turn(tok), kw["eos_token_id"]
        if eot is not None and eot != eos:
            kw["eos_token_id"] = eot if eos is None else [eot, eos]
        return kw

    def prompt_ids(self, tok: Any, ids: list[list[int]]) -> list[list[int]]:
        from stages.models.hf import special_affixes

        _, tail = special_affixes(tok)  # the prompt without its closing special (evaluate's prompt_of)
        return [x[:len(x) - len(tail)] if tail else x for x in ids]


METHOD = SFT()
