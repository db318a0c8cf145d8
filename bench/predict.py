"""Inference on the demo's export, every way this project ships it, against transformers' `pipeline()`, in one
process: 1,000 real held-out reviews (../shared/data/imdb/test.csv.gz, a seeded sample of both labels), each
path timed on the same texts, interleaved (all paths once, then again), at 1 and at 2 threads.

Rows: `pipeline("text-classification")` with its defaults (batch size 1; truncation=True added: longer
reviews fail without it) and with batch_size=8; `finetune predict` with the torch runtime (length-sorted
batches, the precision the run evaluated in); the export's ONNX files in onnxruntime, fp32 and int8
(`--runtime onnx` / `onnx-int8`, export.formats: [hf, onnx]). Per row: best time, reviews/s, the speed ratio
to the pipeline's defaults, label agreement with it, and accuracy against the reviews' labels. Model loading is
outside the timings; the start-up of a one-text command (import + load + predict) is timed in fresh processes.

    OMP_NUM_THREADS=1 .venv/bin/python bench/predict.py [--n 1000] [--repeats 2] [--threads 1,2]

The demo (and its export with ONNX) is computed first when the store does not hold it (about 4 minutes).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ONNX = ["export.formats=[hf, onnx]", "export.onnx_int8=true"]


def reviews(n: int) -> tuple[list[str], list[int]]:
    with gzip.open(ROOT.parent / "shared" / "data" / "imdb" / "test.csv.gz", "rt", newline="") as f:
        rows = list(csv.DictReader(f))
    random.Random(0).shuffle(rows)
    return [r["text"] for r in rows[:n]], [int(r["label"]) for r in rows[:n]]


def onnx(folder: Path, runtime: str, threads: int) -> object:
    """The export with its ONNX file in onnxruntime, on `threads` intra-op threads."""
    from stages.common.exported import load_export
    from stages.common.onnx_export import session

    ex = load_export(folder, runtime=runtime)
    ex.model.sess = session(ex.model.path, threads)
    return ex


def startup(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--batch-size", type=int, default=None, help="finetune predict's (default: its own)")
    args = p.parse_args()

    import torch
    from transformers import pipeline

    from stages.common.exported import load_export, predict
    from stages.engine.config import load_pipeline
    from stages.engine.remote_store import open_store
    from stages.engine.runner import execute
    from stages.graph import GRAPH

    t0 = time.perf_counter()
    store = open_store()
    outcomes = {o.stage: o for o in execute(GRAPH.plan(load_pipeline("demo", ONNX), store), store)}
    folder = outcomes["export"].path
    print(f"load average {os.getloadavg()[0]:.2f}; export {folder} ({'trained' if outcomes['train'].computed else 'cached'}"
          f", {time.perf_counter() - t0:.0f} s)", flush=True)
    texts, gold = reviews(args.n)
    names = None
    table = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        pipe = pipeline("text-classification", model=str(folder), device="cpu")
        paths = {"pipeline() defaults": pipe, "pipeline(batch_size=8)": pipe,
                 "finetune predict (torch)": load_export(folder),
                 "ONNX fp32 (--runtime onnx)": onnx(folder, "onnx", threads),
                 "ONNX int8 (--runtime onnx-int8)": onnx(folder, "onnx-int8", threads)}
        names = names or paths["finetune predict (torch)"].model.config.id2label
        times: dict[str, list[float]] = {k: [] for k in paths}
        labels: dict[str, list[str]] = {}
        for _ in range(args.repeats):
            for name, runner in paths.items():
                t = time.perf_counter()
                if name == "pipeline() defaults":
                    got = [r["label"] for r in runner(texts, truncation=True)]
                elif name == "pipeline(batch_size=8)":
                    got = [r["label"] for r in runner(texts, truncation=True, batch_size=8)]
                else:
                    got = [r["label"] for r in predict(runner, texts, args.batch_size)]
                times[name].append(time.perf_counter() - t)
                labels[name] = got
        base = labels["pipeline() defaults"]
        ids = {v: int(k) for k, v in names.items()}
        for name in paths:
            best = min(times[name])
            agree = sum(a == b for a, b in zip(labels[name], base, strict=True))
            acc = sum(ids[a] == g for a, g in zip(labels[name], gold, strict=True)) / len(gold)
            table.append((threads, name, best, args.n / best, min(times["pipeline() defaults"]) / best, agree, acc))
            print(f"  {threads} thread(s) {name:<32} {best:7.2f} s  load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"\n{args.n} held-out IMDB reviews, the demo's export (all-MiniLM-L6-v2 + LoRA, merged), best of "
          f"{args.repeats} interleaved repeats; load average {os.getloadavg()[0]:.2f}\n")
    print("| threads | path | best s | reviews/s | vs pipeline() defaults | labels as pipeline() | accuracy |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for threads, name, best, rate, ratio, agree, acc in table:
        print(f"| {threads} | {name} | {best:.2f} | {rate:.1f} | {ratio:.2f}x | {agree}/{args.n} | {acc:.4f} |")
    one = ["--text", "A wonderful, moving film."]
    py = sys.executable
    starts = {"finetune predict FOLDER --text (torch)": [py, "-m", "flows.predict", str(folder), *one],
              "finetune predict FOLDER --text --runtime onnx": [py, "-m", "flows.predict", str(folder), *one,
                                                                 "--runtime", "onnx"],
              "python -c pipeline(...)(text)": [py, "-c", "from transformers import pipeline; "
                                                f"print(pipeline('text-classification', model={str(folder)!r})"
                                                "('A wonderful, moving film.'))"]}
    print("\n| start-up: one text, a fresh process (import + load + predict) | s (best of 2) |\n|---|---:|")
    for name, argv in starts.items():
        print(f"| {name} | {min(startup(argv) for _ in range(2)):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
