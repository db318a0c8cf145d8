"""Tiny random models and synthetic tokenized rows for the train-stage tests (CPU, fp32, no dropout)."""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from stages.pipeline.schema import TrainConfig

VOCAB = 64
PAD = 0


def tiny_classifier(seed: int = 0, dropout: float = 0.0) -> torch.nn.Module:
    from transformers import BloomConfig, BloomForSequenceClassification

    torch.manual_seed(seed)
    cfg = BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB, pad_token_id=PAD, num_labels=2,
                      hidden_dropout=dropout, attention_dropout=dropout)
    return BloomForSequenceClassification(cfg)


def tiny_t5(seed: int = 0) -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=VOCAB,
                   decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=1, dropout_rate=0.0)
    return T5ForConditionalGeneration(cfg)


def cls_rows(n: int, seed: int = 0, lo: int = 4, hi: int = 40) -> list[dict[str, Any]]:
    """Uneven lengths; the label says whether low ids (< VOCAB/2) are the majority (learnable)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = i % 2
        length = rng.randint(lo, hi)
        ids = [rng.randint(2, VOCAB // 2 - 1) if (rng.random() < 0.8) == bool(label) else
               rng.randint(VOCAB // 2, VOCAB - 1) for _ in range(length)]
        rows.append({"input_ids": ids, "labels": label, "length": length})
    return rows


def s2s_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Uneven inputs and targets: the target copies the first few input tokens."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [rng.randint(2, VOCAB - 1) for _ in range(rng.randint(4, 30))]
        tgt = ids[: rng.randint(2, min(10, len(ids)))] + [1]
        rows.append({"input_ids": ids, "labels": tgt, "length": len(ids)})
    return rows


def tcfg(**kw: Any) -> TrainConfig:
    base = {"lr": 1e-3, "seed": 7, "checkpoint_every": 1000, "log_every": 5}
    return TrainConfig(**{**base, **kw})


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def window_grads(make_model, rows, micro: int, task: str, tmp_path, monkeypatch) -> dict[str, torch.Tensor]:
    """The gradients the train loop's first step holds when its health check runs (after the window, before
    the optimizer step; no clipping): all `rows` in one effective batch of micro-batches of `micro` rows."""
    from stages.train import train_model
    from stages.training.health import Watchdog

    model, seen = make_model(), {}
    real_check = Watchdog.check

    def check(self, progress, loss, norm):
        seen.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return real_check(self, progress, loss, norm)

    monkeypatch.setattr(Watchdog, "check", check)
    accum = -(-len(rows) // micro)  # every row in the one step: micro x accum >= len(rows)
    train_model(model, rows, None, tcfg(micro_batch_size=micro, gradient_accumulation_steps=accum, max_steps=1),
                task, PAD, tmp_path / f"out{micro}", tmp_path / f"work{micro}", logging.getLogger("test.train"))
    return seen
