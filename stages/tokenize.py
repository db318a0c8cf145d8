"""Tokenize stage: the data stage's splits -> token ids, saved with `datasets` save_to_disk.

No padding is stored (batches are padded dynamically at train time). Inputs longer than
`tokenize.max_length` keep their head and the tokenizer's closing special tokens. The manifest
records token-length stats per split (mean, p50, p95, max, share truncated).
"""

from __future__ import annotations

import logging
from typing import Any, cast

import numpy as np

from stages.common.arrow import read_split
from stages.common.batching import IGNORE_INDEX
from stages.common.hf import load_tokenizer, special_affixes
from stages.common.progress import iterate
from stages.engine.schema import TokenizeConfig
from stages.engine.stage import StageContext


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
                       t: TokenizeConfig) -> tuple[list, list]:
    """Causal LM rows: prompt + target + EOS, loss on the target only. The target (cut to
    max_target_length) always fits: the prompt's head is what gets cut to make room. `targets` are
    texts, or their bare ids (bare_ids: no special tokens) when the caller already has them."""
    _, tail = special_affixes(tok)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    limit = (t.max_target_length or t.max_length) - len(eos)
    if targets and isinstance(targets[0], str):
        targets = tok(targets, add_special_tokens=False)["input_ids"]
    target_ids = cast(list[list[int]], targets)
    ids, labels = [], []
    for p, y in zip(prompts, target_ids, strict=True):
        p = p[: len(p) - len(tail)] if tail else p
        y = y[: max(limit, 1)] + eos
        p = p[: max(t.max_length - len(y), 1)]
        ids.append(p + y)
        labels.append([IGNORE_INDEX] * len(p) + y)
    return ids, labels


def length_stats(lengths: list[int], limit: int | None) -> dict[str, float]:
    a = np.asarray(lengths)
    kept = np.minimum(a, limit) if limit else a
    return {
        "count": int(a.size),
        "mean": round(float(kept.mean()), 2),
        "p50": float(np.percentile(kept, 50)),
        "p95": float(np.percentile(kept, 95)),
        "max": int(kept.max()),
        "untruncated_max": int(a.max()),
        "truncated_share": round(float((a > limit).mean()), 4) if limit else 0.0,
        "tokens": int(kept.sum()),
    }


def run(ctx: StageContext) -> dict[str, Any]:
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    cfg, t = ctx.cfg, ctx.cfg.tokenize
    task = cfg.model.task
    tok = load_tokenizer(cfg)
    data_dir = ctx.upstream["data"]
    splits = [s for s in ("train", "validation", "test") if (data_dir / f"{s}.arrow").exists()]
    out, stats = {}, {}
    for name in splits:
        table = read_split(data_dir, name)
        texts = [t.prefix + x for x in table.column("text").to_pylist()]
        ids, lengths = encode(tok, texts, t.max_length, t.batch_size, f"tokenize {name}")
        cols: dict[str, Any] = {"id": table.column("id").to_pylist()}
        stats[name] = {"input": length_stats(lengths, t.max_length)}
        has_target = "target" in table.column_names
        if task == "seq_cls":
            cols["labels"] = table.column("label").to_pylist()
        elif has_target:
            bare = bare_ids(tok, table.column("target").to_pylist(), t.batch_size, f"tokenize {name} targets")
            tgt_ids, tgt_len = with_specials(tok, bare, t.max_target_length)
            stats[name]["target"] = length_stats(tgt_len, t.max_target_length)
            if task == "seq2seq":
                cols["labels"] = tgt_ids
            else:  # the same bare ids, tokenized once
                ids, cols["labels"] = prompt_then_target(tok, ids, bare, t)
        else:
            cols["labels"] = ids
        cols["input_ids"] = ids
        cols["length"] = [len(x) for x in ids]
        # a fixed fingerprint keeps save_to_disk byte-identical across reruns
        out[name] = datasets.Dataset(InMemoryTable(pa.table(cols)), fingerprint=f"tokenized-{name}")
    datasets.disable_progress_bars()
    datasets.DatasetDict(out).save_to_disk(str(ctx.out_dir / "dataset"))
    tok.save_pretrained(str(ctx.out_dir / "tokenizer"))
    ctx.log.info("tokenize: %s", {k: v["input"]["mean"] for k, v in stats.items()})
    return {"tokenizer": type(tok).__name__, "vocab_size": len(tok), "lengths": stats}
