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
    .venv/bin/python bench/predict.py --smoke    # tiny-imdb's random classifier, 8 reviews, 1 thread: seconds

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
from benchlib import header, parser, require, row  # noqa: E402

ONNX = ["export.formats=[hf, onnx]", "export.onnx_int8=true"]
# the smoke's export: tiny-imdb's random classifier on the other smokes' settings (their stages shared), with ONNX
SMOKE = ("tiny-imdb", ["data.subset={train: 32, validation: 8, test: 8}", "train.max_steps=2", *ONNX])


def export_folder(smoke: bool) -> Path:
    """The demo's export with ONNX (the smoke: tiny-imdb's), computed first when the store does not hold it."""
    from stages.engine.remote_store import open_store
    from stages.engine.runner import execute
    from stages.graph import GRAPH
    from stages.pipeline.loading import load_pipeline

    t0 = time.perf_counter()
    store = open_store()
    name, sets = SMOKE if smoke else ("demo", ONNX)
    outcomes = {o.stage: o for o in execute(GRAPH.plan(load_pipeline(name, sets), store), store)}
    print(f"load average {os.getloadavg()[0]:.2f}; export {outcomes['export'].path} "
          f"({'trained' if outcomes['train'].computed else 'cached'}, {time.perf_counter() - t0:.0f} s)", flush=True)
    return outcomes["export"].path


def reviews(n: int) -> tuple[list[str], list[int]]:
    with gzip.open(ROOT.parent / "shared" / "data" / "imdb" / "test.csv.gz", "rt", newline="") as f:
        rows = list(csv.DictReader(f))
    random.Random(0).shuffle(rows)
    return [r["text"] for r in rows[:n]], [int(r["label"]) for r in rows[:n]]


def onnx(folder: Path, runtime: str, threads: int) -> object:
    """The export with its ONNX file in onnxruntime, on `threads` intra-op threads."""
    from stages.formats.onnx_export import session
    from stages.runtimes.exported import load_export

    ex = load_export(folder, runtime=runtime)
    ex.model.sess = session(ex.model.path, threads)
    return ex


def startup(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - t


def cli() -> argparse.ArgumentParser:
    p = parser(__doc__)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--batch-size", type=int, default=None, help="finetune predict's (default: its own)")
    return p


def main() -> int:
    args = cli().parse_args()
    require("onnxruntime", "onnx")
    if args.smoke:
        args.n, args.repeats, args.threads = 8, 1, "1"

    import torch
    from transformers import pipeline

    from stages.runtimes.exported import load_export, predict

    folder = export_folder(args.smoke)
    texts, gold = reviews(args.n)
    print(f"\n{args.n} held-out IMDB reviews, the {'tiny-imdb' if args.smoke else 'demo'}'s export, best of "
          f"{args.repeats} interleaved repeats; each thread count's rows as they end\n", flush=True)
    header(["threads", "path", "best s", "reviews/s", "vs pipeline() defaults", "labels as pipeline()", "accuracy"],
           ":-:::::")
    names = None
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
            row([threads, name, f"{best:.2f}", f"{args.n / best:.1f}", f"{min(times['pipeline() defaults']) / best:.2f}x",
                 f"{agree}/{args.n}", f"{acc:.4f}"])
    print(f"\nload average {os.getloadavg()[0]:.2f}")
    one = ["--text", "A wonderful, moving film."]
    py = sys.executable
    starts = {"finetune predict FOLDER --text (torch)": [py, "-m", "flows.predict", str(folder), *one],
              "finetune predict FOLDER --text --runtime onnx": [py, "-m", "flows.predict", str(folder), *one,
                                                                 "--runtime", "onnx"],
              "python -c pipeline(...)(text)": [py, "-c", "from transformers import pipeline; "
                                                f"print(pipeline('text-classification', model={str(folder)!r})"
                                                "('A wonderful, moving film.'))"]}
    tries = 1 if args.smoke else 2
    print()
    header(["start-up: one text, a fresh process (import + load + predict)", f"s (best of {tries})"])
    for name, argv in starts.items():
        row([name, f"{min(startup(argv) for _ in range(tries)):.2f}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
