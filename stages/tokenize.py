"""Tokenize stage: the data stage's splits -> token ids, saved with `datasets` save_to_disk.

No padding is stored (batches are padded dynamically at train time). Inputs longer than
`tokenize.max_length` keep their head and the tokenizer's closing special tokens (stages/text/tokens.py;
sft prompt + target: the prompt's head is cut); each row's columns are its method's (stages/methods/: class ids,
target ids, prompt + target, or whatever a method's features hold). Conversations are rendered with the chat
template (stages/text/chat.py). The manifest records token-length stats per split (mean, p50, p95, max, share
truncated, over what max_length cuts: sft prompt + target).

Packing (tokenize.packing, sft): the train split's rows, each already cut to max_length with its own
labels, are packed into sequences of up to max_length tokens by best-fit decreasing (stages/text/packing.py:
deterministic, and TRL's strategy, so bench/sft.py compares like with like). A packed row's `id` lists its rows'
ids, `position_ids` restart at 0 per row (the train step gives the model these and no attention mask: a
block-diagonal causal mask), each row's first token carries no label (the row before never predicts it) and
`length` is the packed length. Validation and test stay one row per sequence. The manifest's `packing`: rows
in, sequences out, fill = real tokens / (sequences x max_length).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from stages.engine.stage import StageContext
from stages.methods.registry import method_in
from stages.models.hf import load_tokenizer
from stages.sources.arrow import read_split
from stages.text.packing import pack_rows


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
    method = method_in(cfg)
    tok = load_tokenizer(cfg)
    data_dir = ctx.upstream["data"]
    splits = [s for s in ("train", "validation", "test") if (data_dir / f"{s}.arrow").exists()]
    template = None
    packing: dict[str, Any] | None = None
    out, stats = {}, {}
    for name in splits:
        table = read_split(data_dir, name)
        rows = method.features(tok, table, t, f"tokenize {name}", cfg.model.name)
        template = rows.template or template
        input_ids = rows.columns["input_ids"]
        cols: dict[str, Any] = {"id": table.column("id").to_pylist(), **rows.columns,
                                "length": [len(x) for x in input_ids]}
        stats[name] = {"input": length_stats(rows.lengths, t.max_length)}
        if rows.target_lengths is not None:
            stats[name]["target"] = length_stats(rows.target_lengths, t.max_target_length)
        if t.packing and name == "train":  # rows -> sequences of up to max_length (stages/text/packing.py)
            packed = pack_rows(input_ids, rows.columns["labels"], t.max_length)
            cols = {"id": [[cols["id"][r] for r in seq] for seq in packed.rows], "labels": packed.labels,
                    "input_ids": packed.input_ids, "position_ids": packed.position_ids,
                    "length": [len(x) for x in packed.input_ids]}
            packing = packed.stats(t.max_length)
        # a fixed fingerprint keeps save_to_disk byte-identical across reruns
        out[name] = datasets.Dataset(InMemoryTable(pa.table(cols)), fingerprint=f"tokenized-{name}")
    datasets.disable_progress_bars()
    datasets.DatasetDict(out).save_to_disk(str(ctx.out_dir / "dataset"))
    if template is not None:
        tok.chat_template = template  # the export ships the template the model was tuned with
    tok.save_pretrained(str(ctx.out_dir / "tokenizer"))
    ctx.log.info("tokenize: %s", {k: v["input"]["mean"] for k, v in stats.items()})
    manifest: dict[str, Any] = {"tokenizer": type(tok).__name__, "vocab_size": len(tok), "lengths": stats}
    if packing is not None:
        manifest["packing"] = packing
        ctx.log.info("tokenize: packed %d train rows into %d sequences of up to %d tokens (fill %.1f%%)",
                     packing["rows"], packing["sequences"], t.max_length, 100 * packing["fill"])
    if template is not None:
        manifest["chat"] = {"template_sha256": hashlib.sha256(template.encode()).hexdigest(),
                            "loss_on": "assistant" if t.loss_on == "auto" else t.loss_on}
    return manifest
