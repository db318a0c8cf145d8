"""Tokenize stage: the data stage's splits -> token ids, saved with `datasets` save_to_disk.

No padding is stored (batches are padded dynamically at train time). Inputs longer than
`tokenize.max_length` keep their head and the tokenizer's closing special tokens (stages/common/tokens.py);
each row's labels are its task's (stages/common/tasks.py: class ids, target ids, or prompt + target). The manifest
records token-length stats per split (mean, p50, p95, max, share truncated).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stages.common.arrow import read_split
from stages.common.hf import load_tokenizer
from stages.common.tasks import task_of
from stages.common.tokens import encode
from stages.engine.stage import StageContext


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
    task = task_of(cfg.model.task)
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
        ids, cols["labels"], target_lengths = task.token_rows(tok, ids, table, t, f"tokenize {name}")
        if target_lengths is not None:
            stats[name]["target"] = length_stats(target_lengths, t.max_target_length)
        cols["input_ids"] = ids
        cols["length"] = [len(x) for x in ids]
        # a fixed fingerprint keeps save_to_disk byte-identical across reruns
        out[name] = datasets.Dataset(InMemoryTable(pa.table(cols)), fingerprint=f"tokenized-{name}")
    datasets.disable_progress_bars()
    datasets.DatasetDict(out).save_to_disk(str(ctx.out_dir / "dataset"))
    tok.save_pretrained(str(ctx.out_dir / "tokenizer"))
    ctx.log.info("tokenize: %s", {k: v["input"]["mean"] for k, v in stats.items()})
    return {"tokenizer": type(tok).__name__, "vocab_size": len(tok), "lengths": stats}
