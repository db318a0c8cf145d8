"""flows.predict against transformers' `pipeline("text-classification")` on the same export, in one process.

Trains (or finds in the store) the demo's shape (all-MiniLM-L6-v2 + LoRA, exported merged) on a small subset
(the bench measures inference, not accuracy), then classifies N real held-out reviews
(../shared/data/imdb/test.csv.gz) both ways, interleaved (A B A B ...), with the same torch thread count:
flows.predict's path (stages/common/exported.py: length-sorted batches) and the pipeline with its defaults
(batch size 1; truncation=True is the one argument added: without it reviews longer than the model's 512
positions fail). Model loading is outside the timings. Prints the table, the speed ratio (goal >= 1.5x) and
whether every label agrees.

    OMP_NUM_THREADS=1 .venv/bin/python bench/predict.py [--n 1000] [--repeats 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRAIN = ["data.subset={train: 128, validation: 8, test: 16}", "train.eval_every=null", "train.select_best=null"]


def reviews(n: int) -> list[str]:
    with gzip.open(ROOT.parent / "shared" / "data" / "imdb" / "test.csv.gz", "rt", newline="") as f:
        rows = csv.DictReader(f)
        return [r["text"] for _, r in zip(range(n), rows, strict=False)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="flows.predict's (its default)")
    p.add_argument("--precision", default="auto", help="flows.predict's autocast (auto: bf16 on CPUs with bf16 units)")
    args = p.parse_args()

    import torch
    from transformers import pipeline

    from stages.common.exported import load_export, predict
    from stages.engine.config import load_pipeline
    from stages.engine.remote_store import open_store
    from stages.engine.runner import execute
    from stages.graph import GRAPH

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    store = open_store()
    outcomes = {o.stage: o for o in execute(GRAPH.plan(load_pipeline("demo", TRAIN), store), store)}
    folder = outcomes["export"].path
    print(f"export {folder} ({'trained' if outcomes['train'].computed else 'cached'}, "
          f"{time.perf_counter() - t0:.0f} s)")
    texts = reviews(args.n)
    ex = load_export(folder)
    pipe = pipeline("text-classification", model=str(folder), device="cpu")

    times: dict[str, list[float]] = {"flows.predict": [], "pipeline (defaults)": []}
    labels: dict[str, list[str]] = {}
    for _ in range(args.repeats):
        t = time.perf_counter()
        ours = predict(ex, texts, args.batch_size, precision=args.precision)
        times["flows.predict"].append(time.perf_counter() - t)
        labels["flows.predict"] = [r["label"] for r in ours]
        t = time.perf_counter()
        theirs = pipe(texts, truncation=True)
        times["pipeline (defaults)"].append(time.perf_counter() - t)
        labels["pipeline (defaults)"] = [r["label"] for r in theirs]

    print(f"\n{args.n} IMDB test reviews, MiniLM + LoRA (merged), {args.threads} torch thread(s), "
          f"{args.repeats} interleaved repeats (best shown)")
    print(f"| {'path':<22} | {'best s':>7} | {'reviews/s':>9} |")
    print(f"|{'-' * 24}|{'-' * 9}|{'-' * 11}|")
    for k, v in times.items():
        print(f"| {k:<22} | {min(v):>7.2f} | {args.n / min(v):>9.1f} |")
    ratio = min(times["pipeline (defaults)"]) / min(times["flows.predict"])
    agree = sum(a == b for a, b in zip(labels["flows.predict"], labels["pipeline (defaults)"], strict=True))
    print(f"\nspeed ratio flows.predict / pipeline: {ratio:.2f}x (goal >= 1.5x); labels agree: {agree}/{args.n}")
    return 0 if agree == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
