"""Batching for the train stage: a seeded, length-grouped order of *effective* batches, each cut into
micro-batches that are padded only to their own longest row.

Why effective batches first: the optimizer sees one effective batch (micro-batch x accumulation) per
step. Choosing its members before cutting it into micro-batches means micro-batch 8 x accumulation 2,
2 x 8 and 16 x 1 all see exactly the same examples per step, so they give the same gradients; the OOM
back-off (halve micro-batch, double accumulation) and a resume after a crash do not change the data.

Grouping by length (the trick HF's `group_by_length` uses): shuffle everything, cut the shuffled order
into "mega-chunks" of `MEGA_CHUNK` effective batches, sort each chunk by length, cut it into effective
batches, then shuffle the effective batches. Rows of similar length share a batch (little padding), and
the order of batches stays random. Everything is a pure function of (seed, epoch), so the position in
an epoch is just "how many effective batches are done".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

MEGA_CHUNK = 50  # effective batches per sorted chunk (HF's megabatch_mult)


def epoch_batches(lengths: Sequence[int], effective_batch: int, seed: int, epoch: int,
                  group_by_length: bool = True) -> list[list[int]]:
    """The effective batches (lists of row indices) of one epoch; the last one may be short."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    if not group_by_length:
        return [order[i:i + effective_batch].tolist() for i in range(0, len(order), effective_batch)]
    lens = np.asarray(lengths)
    chunk = effective_batch * MEGA_CHUNK
    batches = []
    for start in range(0, len(order), chunk):
        part = order[start:start + chunk]
        part = part[np.argsort(-lens[part], kind="stable")]  # longest first within the chunk
        batches += [part[i:i + effective_batch].tolist() for i in range(0, len(part), effective_batch)]
    # a short last batch stays last (so every other batch is full); the full ones are shuffled
    full = [b for b in batches if len(b) == effective_batch]
    short = [b for b in batches if len(b) != effective_batch]
    perm = rng.permutation(len(full))
    return [full[i] for i in perm] + short


def split_micro(batch: list[int], lengths: Sequence[int], micro_batch: int) -> list[list[int]]:
    """Cut an effective batch into micro-batches of similar length (longest first, so an OOM shows early)."""
    rows = sorted(batch, key=lambda i: (-lengths[i], i))
    return [rows[i:i + micro_batch] for i in range(0, len(rows), micro_batch)]


def shard(batch: list[int], lengths: Sequence[int], rank: int, world: int) -> list[int]:
    """Process `rank`'s share of an effective batch when `world` processes train together: the rows sorted
    as split_micro sorts them, dealt round-robin, so shares are disjoint, cover the batch, and get rows
    of similar lengths. The optimizer step still sees the whole effective batch (gradients are all-reduced),
    so N processes x micro-batch m x accumulation a see the rows 1 process x m x (a N) sees."""
    rows = sorted(batch, key=lambda i: (-lengths[i], i))
    return rows[rank::world]


@dataclass
class Batch:
    """A collated micro-batch: named tensors (a method's collate decides which), the units its loss is summed
    over (rows, target tokens, pairs...), and the tokens computed with and without padding."""

    tensors: dict[str, torch.Tensor]
    units: int
    real_tokens: int  # non-pad input tokens
    padded_tokens: int  # tokens computed, padding included (rows x longest row)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    def to(self, device: torch.device | str) -> Batch:
        return replace(self, tensors={k: v.to(device) for k, v in self.tensors.items()})

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]


class Collates(Protocol):
    """What batching needs of a method (stages/methods/base.py): its collate."""

    def collate(self, rows: list[dict], pad_id: int) -> Batch: ...


def pad_tokens(rows: list[dict], pad_id: int, column: str = "input_ids"
               ) -> tuple[dict[str, torch.Tensor], int, int]:
    """Rows' token ids padded to the longest (right padding): {input_ids, attention_mask[, position_ids]}, the
    real and the computed token counts. Packed sequences (a position_ids column) keep their position ids, and
    the padding after them counts 0, 1, ... as a row of its own: causal attention never lets a real token see
    the padding after it, and the padding's labels are ignored, so padding cannot change the real tokens' loss."""
    width = max(len(r[column]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    packed = "position_ids" in rows[0]
    pos = torch.arange(width, dtype=torch.long).repeat(len(rows), 1) if packed else None
    for i, r in enumerate(rows):
        n = len(r[column])
        ids[i, :n] = torch.as_tensor(r[column], dtype=torch.long)
        mask[i, :n] = 1
        if pos is not None:
            pos[i, :n] = torch.as_tensor(r["position_ids"], dtype=torch.long)
            pos[i, n:] = torch.arange(width - n)
    out = {"input_ids": ids, "attention_mask": mask}
    if pos is not None:
        out["position_ids"] = pos
    return out, int(mask.sum()), ids.numel()


def padding_share(batches: list[list[int]], lengths: Sequence[int], micro_batch: int) -> float:
    """Share of computed tokens that are padding when these effective batches are cut into micro-batches."""
    real = computed = 0
    for b in batches:
        for mb in split_micro(b, lengths, micro_batch):
            ls = [lengths[i] for i in mb]
            real += sum(ls)
            computed += max(ls) * len(ls)
    return 1 - real / computed if computed else 0.0


class Rows:
    """Row access to a tokenized split (a datasets.Dataset or a list of dicts, for tests)."""

    def __init__(self, ds: Any):
        self.ds = ds
        if isinstance(ds, list):
            self.lengths = [len(r["input_ids"]) for r in ds]
        else:
            cols = ds.column_names
            self.lengths = list(ds["length"]) if "length" in cols else [len(x) for x in ds["input_ids"]]

    @property
    def packed(self) -> bool:
        """Rows packed into sequences by the tokenize stage (tokenize.packing): a position_ids column."""
        if isinstance(self.ds, list):
            return bool(self.ds) and "position_ids" in self.ds[0]
        return "position_ids" in self.ds.column_names

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, idx: list[int]) -> list[dict]:
        """The rows, each with every column the method wrote (the row's id and length aside)."""
        if isinstance(self.ds, list):
            return [self.ds[i] for i in idx]
        names = [c for c in self.ds.column_names if c not in ("id", "length")]
        cols = self.ds[idx]
        return [{k: cols[k][j] for k in names} for j in range(len(idx))]

    def batches(self, idx: list[int], micro: int, pad_id: int, method: Collates) -> list[Batch]:
        return [method.collate(self.get(mb), pad_id) for mb in split_micro(idx, self.lengths, micro)]


def validation_rows(val_ds: Any, max_examples: int | None) -> Rows | None:
    """The validation split's rows (its first `max_examples`), None when there are none."""
    if val_ds is None or not len(val_ds):
        return None
    if max_examples is not None and max_examples < len(val_ds):
        val_ds = val_ds[:max_examples] if isinstance(val_ds, list) else val_ds.select(range(max_examples))
    return Rows(val_ds)
