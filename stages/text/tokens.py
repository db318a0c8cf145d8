"""Token ids of texts, shaped the way every stage and task reads them: the tokenizer's special tokens kept
when a text is cut to a length, and a causal LM's prompt + target rows with the loss on the target only. The
tokenize stage writes these rows; the methods (stages/methods/) build their features with them."""

from __future__ import annotations

import logging
from typing import Any, cast

from stages.engine.progress import iterate
from stages.models.hf import IGNORE_INDEX, special_affixes
from stages.pipeline.schema import TokenizeConfig


def bare_ids(tok: Any, texts: list[str], batch_size: int, desc: str) -> list[list[int]]:
    """Token ids without special tokens, untruncated, tokenized batch_size texts at a time."""
    out: list[list[int]] = []
    for i in iterate(range(0, len(texts), batch_size), desc, logging.getLogger("finetune.tokenize")):
        out.extend(tok(texts[i:i + batch_size], add_special_tokens=False)["input_ids"])
    return out


def with_specials(tok: Any, seqs: list[list[int]], max_length: int | None) -> tuple[list, list]:
    """Bare ids -> (ids with the special tokens, truncated to max_length keeping the closing specials,
    untruncated lengths)."""
    head, tail = special_affixes(tok)
    ids, lengths = [], []
    for seq in seqs:
        full = len(head) + len(seq) + len(tail)
        lengths.append(full)
        if max_length is not None and full > max_length:
            seq = seq[: max(max_length - len(head) - len(tail), 0)]
        ids.append(head + seq + tail)
    return ids, lengths


def encode(tok: Any, texts: list[str], max_length: int | None, batch_size: int, desc: str) -> tuple[list, list]:
    """(ids truncated to max_length keeping the closing specials, untruncated lengths)."""
    return with_specials(tok, bare_ids(tok, texts, batch_size, desc), max_length)


def prompt_then_target(tok: Any, prompts: list[list[int]], targets: list[str] | list[list[int]],
                       t: TokenizeConfig) -> tuple[list, list, list[int], list[int]]:
    """Causal LM rows: prompt + target + EOS, the loss on the target only (tokenize.loss_on completion; all:
    on every token). The target (cut to max_target_length) always fits: the prompt's head is what gets cut
    to make room (its leading special tokens and its end, the cue before the answer, stay). `targets` are
    texts, or their bare ids (bare_ids: no special tokens) when the caller already has them. Also returns
    each row's untruncated length (prompt + target) and its prompt's length (where generation starts)."""
    head, tail = special_affixes(tok)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    limit = min(t.max_target_length or t.max_length, t.max_length - len(head) - 1) - len(eos)
    if targets and isinstance(targets[0], str):
        targets = tok(targets, add_special_tokens=False)["input_ids"]
    target_ids = cast(list[list[int]], targets)
    ids, labels, lengths, prompt_lengths = [], [], [], []
    for p, y in zip(prompts, target_ids, strict=True):
        p = p[: len(p) - len(tail)] if tail else p
        lengths.append(len(p) + len(y) + len(eos))
        y = y[: max(limit, 1)] + eos
        room = max(t.max_length - len(y) - len(head), 1)
        body = p[len(head):]
        p = head + body[max(len(body) - room, 0):]
        ids.append(p + y)
        prompt_lengths.append(len(p))
        labels.append(p + y if t.loss_on == "all" else [IGNORE_INDEX] * len(p) + y)
    return ids, labels, lengths, prompt_lengths
