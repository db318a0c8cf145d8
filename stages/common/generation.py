"""Batched generation from token prompts (the evaluate stage's predictions, validation's ROUGE during
training), and the prompt of a causal_lm row."""

from __future__ import annotations

import logging
from typing import Any

import torch

from stages.common.batching import IGNORE_INDEX, split_micro
from stages.common.hf import special_affixes
from stages.common.progress import iterate

log = logging.getLogger("finetune.evaluate")


def prompt_of(input_ids: list[int], labels: list[int]) -> list[int]:
    """causal_lm rows are prompt + target with the prompt's labels masked: the prompt is that prefix."""
    n = next((k for k, y in enumerate(labels) if y != IGNORE_INDEX), len(labels))
    return input_ids[:n]


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: list[list[int]], tok: Any, gen: dict[str, Any], batch_size: int,
             device: torch.device, decoder_only: bool, desc: str) -> tuple[list[str], list[int]]:
    """Batched generation: (decoded texts, generated token counts), in the order of `prompts`.
    Encoder-decoder inputs are padded on the right, decoder-only prompts on the left."""
    texts: list[str] = [""] * len(prompts)
    counts: list[int] = [0] * len(prompts)
    lengths = [len(p) for p in prompts]
    pad = tok.pad_token_id
    eos = gen.get("eos_token_id")
    stops = set(eos if isinstance(eos, list) else [eos]) - {None} or {pad}
    for idx in iterate(split_micro(list(range(len(lengths))), lengths, batch_size), desc, log):
        width = max(len(prompts[j]) for j in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, j in enumerate(idx):
            p = torch.as_tensor(prompts[j], dtype=torch.long)
            if decoder_only:
                ids[r, width - len(p):], mask[r, width - len(p):] = p, 1
            else:
                ids[r, :len(p)], mask[r, :len(p)] = p, 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **gen)
        # decoder-only: the prompt comes back first; encoder-decoder: the decoder start token does
        new = out[:, width:] if decoder_only else out[:, 1:]
        for r, j in enumerate(idx):
            seq = new[r].tolist()
            end = next((k for k, t in enumerate(seq) if t in stops), None)
            seq = seq if end is None else seq[:end + 1]  # a finished row is padded after its end token
            counts[j] = len(seq)
            texts[j] = tok.decode(seq, skip_special_tokens=True).strip()
    return texts, counts


def stop_token(tok: Any, model: torch.nn.Module) -> int | None:
    """The token the targets were tokenized to end with (the tokenizer's closing special), else EOS."""
    _, tail = special_affixes(tok)
    return tail[-1] if tail else (tok.eos_token_id if tok.eos_token_id is not None else model.config.eos_token_id)


def decoded_targets(tok: Any, labels: list[list[int]]) -> list[str]:
    """The target texts of tokenized rows (their labels, masked positions dropped), as generation decodes."""
    return [tok.decode([t for t in y if t != IGNORE_INDEX], skip_special_tokens=True).strip() for y in labels]
