"""The train stage on the `imdb-90` recipe (all-MiniLM-L6-v2 + LoRA, reviews x 512 tokens, micro-batch 1 x
accumulation 16) in fp32 and in bf16 autocast, interleaved, a few optimizer steps each, and what that makes
of the sweep's measured wall time (docs/results.md#beyond-the-article-on-2-cpu-cores-the-imdb-90-sweep: 62 min
56 s in fp32, 3,632 s of it training, 98 s test evaluation).

Each round trains a fresh copy of the adapters stage's model for `--steps` optimizer steps in each precision
(the same rows, the same seed); the steady rate is over steps 2..N (step 1 warms up), in wall time and in the
process's CPU time (the steadier one on a machine shared with other jobs). The projection scales the
measured fp32 training time by the fp32/bf16 ratio of the CPU-time rates and keeps the rest (evaluation,
setup) as measured: a projection, not a measurement of the hour-long run.

    .venv/bin/python bench/precision_imdb90.py                   # 2 rounds x 4 steps, 1 thread, ~5 min quiet
    .venv/bin/python bench/precision_imdb90.py --rounds 3 --steps 6 --threads 2
    .venv/bin/python bench/precision_imdb90.py --smoke   # tiny-imdb's random model, 1 round of 2 steps of 1 x 2
"""

from __future__ import annotations

import argparse
import contextlib
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
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from benchlib import header, parser, row  # noqa: E402


def cli() -> argparse.ArgumentParser:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per training (>= 2)")
    ap.add_argument("--threads", type=int, default=1)
    return ap


if __name__ == "__main__":
    cli().parse_args()  # --help and a bad flag answered before the heavy imports below

import torch  # noqa: E402

from stages.engine.remote_store import open_store  # noqa: E402
from stages.engine.runner import execute  # noqa: E402
from stages.graph import GRAPH  # noqa: E402
from stages.models.hf import load_tokenizer  # noqa: E402
from stages.models.model_loading import load_trainable  # noqa: E402
from stages.pipeline.loading import load_pipeline  # noqa: E402
from stages.train import TrainRun, train_model  # noqa: E402
from stages.training.device import training_device  # noqa: E402

# the imdb-90 sweep's settings (pipeline.yaml `sweeps: imdb-90`; accumulation 16, set in main), on a small train
# subset: only a few steps run
IMDB90 = ["tokenize.max_length=512", "train.micro_batch_size=1", "train.eval_every=null", "train.select_best=null"]
MEASURED = {"wall_s": 62 * 60 + 56, "train_s": 3632, "evaluate_s": 98}  # docs/results.md#in-bf16-inside-the-hour, the 8,192-review variant, fp32


@contextlib.contextmanager
def after_each_step(act):
    """`act()` after each finished optimizer step (TrainRun.stop_here: also once after the loop, no step)."""
    real = TrainRun.stop_here

    def stop_here(self):
        act()
        real(self)

    TrainRun.stop_here = stop_here
    try:
        yield
    finally:
        TrainRun.stop_here = real


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def main() -> None:
    args = cli().parse_args()
    # the smoke: tiny-imdb's random model on the same recipe, accumulation 2 instead of 16
    pipeline, accumulation = ("tiny-imdb", 2) if args.smoke else ("demo", 16)
    if args.smoke:
        args.rounds, args.steps = 1, 2
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    reviews = accumulation * args.steps
    cfg = load_pipeline(pipeline, [*IMDB90, f"train.gradient_accumulation_steps={accumulation}",
                                   f"data.subset={{train: {reviews}, validation: 8, test: 8}}"])
    store = open_store()
    up = {o.stage: o.path for o in execute(GRAPH.plan(cfg, store, until="adapters"), store)}
    import datasets

    ds = datasets.load_from_disk(str(up["tokenize"] / "dataset"))
    pad_id = load_tokenizer(up["tokenize"] / "tokenizer").pad_token_id
    print(f"imdb-90 recipe on {pipeline}, {reviews} real reviews x <= 512 tokens, {args.steps} steps of 1 x "
          f"{accumulation}, {args.threads} thread(s), {training_device()}", flush=True)
    rates: dict[str, list[tuple[float, float]]] = {"no": [], "bf16": []}
    for r in range(args.rounds):
        for prec in rates:  # interleaved
            model = load_trainable(up["model"], up["adapters"])
            ends: list[tuple[float, float]] = []
            tcfg = cfg.train.model_copy(update={"mixed_precision": prec, "max_steps": args.steps,
                                                "checkpoint_every": 10**6, "log_every": 10**6})
            with tempfile.TemporaryDirectory() as d, after_each_step(lambda ends=ends: ends.append(clocks())):
                m = train_model(model, ds["train"], None, tcfg, "seq_cls", pad_id, Path(d) / "o", Path(d) / "w",
                                logging.getLogger("bench"))
                ends.pop()  # the call after the loop
                recs = [json.loads(x) for x in (Path(d) / "o" / "metrics.jsonl").read_text().splitlines()]
            tokens = sum(x["real_tokens"] for x in recs if x.get("kind") == "train")
            first = next(x["real_tokens"] for x in recs if x.get("kind") == "train")
            wall, cpu = ends[-1][0] - ends[0][0], ends[-1][1] - ends[0][1]
            rates[prec].append(((tokens - first) / wall, (tokens - first) / cpu))
            print(f"  round {r + 1} {m['precision']:>4}: steps 2..{args.steps} {rates[prec][-1][0]:.0f} tok/s wall, "
                  f"{rates[prec][-1][1]:.0f} tok/s CPU", flush=True)
    med = {p: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for p, v in rates.items()}
    speedup = med["bf16"][1] / med["no"][1]
    print()
    header(["precision", "steady tok/s wall (median)", "steady tok/s CPU (median)", "vs fp32 (CPU)"])
    for p, (w, c) in med.items():
        row(["fp32" if p == "no" else p, f"{w:.0f}", f"{c:.0f}", f"{c / med['no'][1]:.2f}x"])
    train_s = MEASURED["train_s"] / speedup
    rest = MEASURED["wall_s"] - MEASURED["train_s"]
    total = train_s + rest
    print()
    print(f"projection (not a measurement): training {MEASURED['train_s']} s / {speedup:.2f} = {train_s:.0f} s, "
          f"+ {rest} s of the rest as measured in fp32 (evaluation {MEASURED['evaluate_s']} s, setup) = "
          f"{total / 60:.0f} min {total % 60:.0f} s against the hour")


if __name__ == "__main__":
    main()
