"""Why batched inference on a CPU gains little, and which batch size `finetune predict` takes there
(docs/export.md#batch-size): the demo's export (with ONNX, as bench/predict.py computes it) in fp32, as on a CPU
without bf16 units (FINETUNE_CPU_BF16_UNITS=), on a seeded sample of held-out reviews. Prints the time per batch
size at 1 and 2 threads (best of 2, interleaved) beside `pipeline()`'s defaults, and a profile of one
`finetune predict` pass (batch 32, 1 thread): where its time goes, by torch operation.

    .venv/bin/python bench/predict_batch.py [--n 200]
    .venv/bin/python bench/predict_batch.py --smoke    # tiny-imdb's random classifier, 8 reviews: seconds
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

os.environ["FINETUNE_CPU_BF16_UNITS"] = ""  # fp32: what a CPU without bf16 units computes in
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from benchlib import header, parser, require  # noqa: E402
from predict import export_folder, reviews  # noqa: E402


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    require("onnxruntime", "onnx")
    if args.smoke:
        args.n = 8

    import torch
    from transformers import pipeline

    from stages.runtimes.exported import load_export, predict

    folder = export_folder(args.smoke)
    texts, _ = reviews(args.n)
    ex = load_export(folder)
    pipe = pipeline("text-classification", model=str(folder), device="cpu")
    print(f"{args.n} reviews, fp32, the {'tiny-imdb' if args.smoke else 'demo'}'s export {folder}\n")
    header(["threads", "pipeline() defaults", "batch 4", "batch 8", "batch 16", "batch 32", "load"], ":" * 7)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {}
        for _ in range(2):
            for name in ("pipeline", 4, 8, 16, 32):
                t = time.perf_counter()
                if name == "pipeline":
                    pipe(texts, truncation=True)
                else:
                    predict(ex, texts, int(name), precision="no")
                times.setdefault(str(name), []).append(time.perf_counter() - t)
        cells = " | ".join(f"{min(v):.2f} s" for v in times.values())
        print(f"| {threads} | {cells} | {os.getloadavg()[0]:.2f} |", flush=True)
    torch.set_num_threads(1)
    prof = cProfile.Profile()
    prof.enable()
    predict(ex, texts, 32, precision="no")
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]  (tottime per function)
    print("\nprofile of one pass (batch 32, 1 thread), share of the time by function:")
    top = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:6]  # type: ignore[attr-defined]
    for (file, line, fn), v in top:
        print(f"  {100 * v[2] / total:5.1f}%  {fn} ({Path(file).name}:{line})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
