"""Boundary-aware packing of causal-LM rows (tokenize.packing): short rows share one sequence of up to
max_length tokens, and nothing of one row reaches another.

    bins = best_fit_decreasing(lengths, max_length)    which rows share a sequence (deterministic)
    packed = pack_rows(ids, labels, max_length)        the sequences' input_ids, labels, position_ids

Best-fit decreasing, as TRL's SFTTrainer packs (`pack_dataset(..., strategy="bfd")`): rows longest first (ties by
row index), each into the open sequence with the least room that still holds it, else a new one. Both it and
first-fit decreasing stay within 11/9 of the fewest sequences possible; best fit fills the tightest gap, which
leaves the roomier sequences open for later rows, and packing as TRL does makes the bench (bench/sft.py) compare
like with like. A row is never split: a row longer than max_length cannot occur (tokenize cut it already).

Keeping rows apart: each row's position ids restart at 0, and the first token of every row carries no label,
so the last token of row i never learns to predict row i+1's first token (the loss compares logits[:, :-1]
with labels[:, 1:]; a row alone never has its first token predicted either, so a packed row's loss is its
unpacked loss). Attention: the train step gives the model these position ids and no attention mask, from which
transformers builds a block-diagonal causal mask (masking_utils.find_packed_sequence_indices; flash attention's
padding-free path reads the same ids). `keeps_rows_apart` checks a model really does that before training.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.text.tokens import IGNORE_INDEX

if TYPE_CHECKING:
    import torch

STRATEGY = "best-fit decreasing"


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Row indices per sequence: each row (longest first, ties by index) into the open sequence with the least
    room that holds it, else a new sequence. Sequences in the order they were opened, rows in the order placed."""
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin index), sorted: the best fit is the first that holds a row
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"row {i} has {n} tokens, more than the {capacity} a sequence holds")
        k = bisect.bisect_left(room, (n, -1))
        if k < len(room):
            left, b = room.pop(k)
        else:
            left, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if left - n > 0:
            bisect.insort(room, (left - n, b))
    return bins


@dataclass(frozen=True)
class Packed:
    """Packed sequences: per sequence its rows (indices into the unpacked rows), input ids, labels (each row's
    first token IGNORE_INDEX) and position ids (restarting at 0 per row)."""

    rows: list[list[int]]
    input_ids: list[list[int]]
    labels: list[list[int]]
    position_ids: list[list[int]]

    def stats(self, max_length: int) -> dict[str, Any]:
        """The manifest's record: rows in, sequences out, fill = real tokens / (sequences x max_length)."""
        tokens = sum(len(x) for x in self.input_ids)
        return {"strategy": STRATEGY, "rows": sum(len(r) for r in self.rows), "sequences": len(self.rows),
                "tokens": tokens, "fill": round(tokens / max(len(self.rows) * max_length, 1), 4)}


def pack_rows(input_ids: list[list[int]], labels: list[list[int]], max_length: int) -> Packed:
    """Rows (each at most max_length tokens, with their own labels) packed into sequences of at most max_length."""
    bins = best_fit_decreasing([len(x) for x in input_ids], max_length)
    ids, labs, pos = [], [], []
    for rows in bins:
        seq_ids: list[int] = []
        seq_labels: list[int] = []
        seq_pos: list[int] = []
        for r in rows:
            seq_ids += input_ids[r]
            seq_labels += [IGNORE_INDEX, *labels[r][1:]]
            seq_pos += range(len(input_ids[r]))
        ids.append(seq_ids)
        labs.append(seq_labels)
        pos.append(seq_pos)
    return Packed(bins, ids, labs, pos)


def keeps_rows_apart(model: torch.nn.Module, device: torch.device | str) -> bool:
    """Whether `model` keeps packed rows apart: the logits of a row packed after another equal its logits
    alone (a forward of a few tokens, no gradients). False for a model that ignores position ids or builds
    its own full causal mask (then packing would let rows attend to each other)."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            row = torch.tensor([[3, 5, 7, 11]], device=device)
            other = torch.tensor([[13, 17, 19]], device=device)
            packed = torch.cat([other, row], dim=1)
            pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]], device=device)
            alone = model(input_ids=row, use_cache=False).logits[0].float()
            after = model(input_ids=packed, position_ids=pos, use_cache=False).logits[0, 3:].float()
        # a tolerance for half-precision and quantized weights; a row that sees another moves far more
        return bool(torch.allclose(alone, after, rtol=1e-2, atol=1e-2 * float(alone.abs().max())))
    finally:
        model.train(was_training)
