"""Reproduce the QLoRA article's memory table on t5-3b, built from its config with random weights
(no download): base fp32 vs NF4 vs QLoRA footprint, total and trainable parameters, reduction
factor, plus a row that also quantizes the `wo` layers T5 keeps in fp32. Each row shows the estimate
that stages.models.memory makes from the config alone beside the measured `get_memory_footprint()`.

    .venv/bin/python bench/memory_table.py            # ~17.5 GB of RAM at its peak (measured); check `free -g` first
    .venv/bin/python bench/memory_table.py --smoke    # the same rows on a tiny T5 (a temporary folder): seconds

The random checkpoint is cached under bench/out/ (git-ignored; bf16, 5.7 GB: random values lose
nothing in bf16, and the base row loads it as fp32), so a rerun skips building it. Results also go
to bench/out/memory_table.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchlib import parser  # noqa: E402


def cli() -> argparse.ArgumentParser:
    p = parser(__doc__)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out", help="cache and results folder")
    return p


if __name__ == "__main__":
    cli().parse_args()  # --help and a bad flag answered before the heavy imports below

import psutil  # noqa: E402
import torch  # noqa: E402

from stages.models import memory, model_loading  # noqa: E402
from stages.models.compat.bitsandbytes import quant_state_bytes  # noqa: E402
from stages.models.compat.transformers import fp32_modules_quantized  # noqa: E402
from stages.models.heads import HEADS  # noqa: E402
from stages.pipeline.schema import AdaptersConfig, ModelConfig, QuantizationConfig  # noqa: E402

# T5 v1.0 3B (the t5-3b config on the hub, written out): relu FFN, tied embeddings.
T5_3B = {"model_type": "t5", "d_model": 1024, "d_ff": 16384, "d_kv": 128, "num_heads": 32, "num_layers": 24,
         "num_decoder_layers": 24, "vocab_size": 32128, "feed_forward_proj": "relu", "tie_word_embeddings": True,
         "relative_attention_num_buckets": 32, "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}
ARTICLE = {"base": 11_406_393_344, "nf4": 4_293_910_528, "trainable": 56_492_032}
TINY_T5 = {**T5_3B, "d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4, "num_layers": 2, "num_decoder_layers": 2}
NF4 = QuantizationConfig(mode="4bit", quant_type="nf4", double_quant=True, compute_dtype="bfloat16")
NF4_WO = NF4.model_copy(update={"quantize_fp32_modules": True})
LORA = AdaptersConfig(method="lora", r=32, alpha=16, dropout=0.05, target_modules=["v", "o"],
                      modules_to_save=["lm_head"], bias="none")
FULL = AdaptersConfig(method="full")
NONE = QuantizationConfig(mode="none")

SEQ2SEQ = HEADS["seq2seq"]  # T5: an encoder-decoder


def configurations(t5: dict[str, Any], name: str) -> tuple[ModelConfig, list[tuple[str, ModelConfig,
                                                                                  QuantizationConfig, str | None]]]:
    """The base model's config and the rows: (row, model config, quantization, the QLoRA row on top of it)."""
    model = ModelConfig(name=f"{name} (random, from config)", num_labels=None, from_config=t5)
    # The article's load: 4-bit with the rest in fp16 (what load_in_4bit defaulted to), where transformers keeps
    # T5's `wo` in fp32. Loading the rest in bf16, transformers 5 leaves `wo` unquantized but in bf16.
    fp16 = model.model_copy(update={"dtype": "float16"})
    bf16 = model.model_copy(update={"dtype": "bfloat16"})
    return model, [
        ("NF4 + double quant (fp16 load: wo fp32)", fp16, NF4, "QLoRA r=32 on v,o + lm_head"),
        ("NF4 incl. wo (bf16 compute)", fp16, NF4_WO, "QLoRA incl. wo"),
        ("NF4, bf16 load (transformers 5: wo bf16)", bf16, NF4, None),
    ]


def rss_gb() -> float:
    return psutil.Process().memory_info().rss / 1e9


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def random_checkpoint(out: Path, config: Any, name: str) -> tuple[Path, float]:
    """bench/out/<name>-random: seeded random weights, saved once."""
    from transformers import AutoModelForSeq2SeqLM

    ckpt = out / f"{name}-random"
    if (ckpt / "config.json").is_file() and list(ckpt.glob("*.safetensors")):
        return ckpt, 0.0
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(ckpt.with_suffix(".tmp"))
    ckpt.with_suffix(".tmp").rename(ckpt)
    del model
    gc.collect()
    return ckpt, time.perf_counter() - t0


def estimate(m: ModelConfig, q: QuantizationConfig, a: AdaptersConfig, config: Any) -> memory.Estimate:
    meta, plan = model_loading.meta_and_plan(m, q, config, SEQ2SEQ)
    return memory.adapters_estimate(memory.weights_estimate(meta, plan), meta, plan, a)


def load(ckpt: Path, m: ModelConfig, q: QuantizationConfig, config: Any) -> Any:
    meta, plan = model_loading.meta_and_plan(m, q, config, SEQ2SEQ)
    cls = type(meta)
    with fp32_modules_quantized(cls, q.quantize_fp32_modules):
        return cls.from_pretrained(ckpt, dtype=plan.dtype, quantization_config=model_loading.bnb_config(q, plan))


def attach_lora(model: Any) -> Any:
    from peft import get_peft_model, prepare_model_for_kbit_training

    from stages.adapters import lora_config

    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    return get_peft_model(model, lora_config(LORA, "seq2seq"))


def row(name: str, model: Any, est_bytes: int, t: float, trains: bool = True, **extra: Any) -> dict[str, Any]:
    """trains=False: a quantized model without adapters (its 4-bit weights cannot be trained)."""
    from stages.adapters import count_parameters

    trainable, total = count_parameters(model)
    trainable = trainable if trains else None
    footprint = int(model.get_memory_footprint())
    r = {"row": name, "footprint": footprint, "estimate": est_bytes, "est_vs_measured": est_bytes / footprint,
         "total_params": total, "trainable_params": trainable, "quant_state": quant_state_bytes(model),
         "seconds": round(time.perf_counter() - t, 1), "rss_gb": round(rss_gb(), 2), **extra}
    print(f"  measured {name}: {footprint:,} B in {r['seconds']} s (RSS {r['rss_gb']} GB)", flush=True)
    return r


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]["footprint"]
    head = ("| configuration | footprint (bytes) | GB | estimate | est./meas. | total params | trainable | "
            "trainable % | reduction |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        n = r["trainable_params"]
        trainable = ("—", "—") if n is None else (f"{n:,}", f"{100 * n / r['total_params']:.2f}%")
        lines.append(f"| {r['row']} | {r['footprint']:,} | {r['footprint'] / 1e9:.2f} | {r['estimate']:,} | "
                     f"{r['est_vs_measured']:.4f} | {r['total_params']:,} | {trainable[0]} | {trainable[1]} | "
                     f"{base / r['footprint']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = cli().parse_args(argv)
    name = "t5-tiny" if args.smoke else "t5-3b"
    if args.smoke:
        args.out = Path(tempfile.mkdtemp(prefix="memory-table-smoke-"))
    args.out.mkdir(parents=True, exist_ok=True)
    base_cfg, variants = configurations(TINY_T5 if args.smoke else T5_3B, name)
    model_loading.quiet_transformers()
    t_all = time.perf_counter()
    config = model_loading.hf_config(base_cfg, SEQ2SEQ)
    ckpt, built_s = random_checkpoint(args.out, config, name)
    how = f"built in {built_s:.0f} s" if built_s else "cached"
    print(f"random {name} checkpoint: {ckpt} ({how})", flush=True)
    rows = []

    t = time.perf_counter()
    model = load(ckpt, base_cfg, NONE, config)
    rows.append(row("base (fp32)", model, estimate(base_cfg, NONE, FULL, config).footprint, t, article=ARTICLE["base"]))
    del model
    gc.collect()

    for name, m, q, lora_name in variants:
        t = time.perf_counter()
        model = load(ckpt, m, q, config)
        rows.append(row(name, model, estimate(m, q, FULL, config).footprint, t, trains=False))
        if lora_name:
            t = time.perf_counter()
            model = attach_lora(model)
            rows.append(row(lora_name, model, estimate(m, q, LORA, config).training_footprint, t))
        del model
        gc.collect()

    wall = time.perf_counter() - t_all
    print()
    print(table(rows))
    base, nf4, qlora = rows[0], rows[1], rows[2]
    note = "(a tiny T5: the article's figures are t5-3b's) " if args.smoke else ""
    print(f"\n{note}base vs article {base['footprint'] / ARTICLE['base'] - 1:+.4%}; NF4 vs article "
          f"{nf4['footprint'] / ARTICLE['nf4'] - 1:+.4%}; trainable {qlora['trainable_params']:,} "
          f"(article {ARTICLE['trainable']:,}); NF4 reduction {base['footprint'] / nf4['footprint']:.3f}x")
    print(f"wall time {wall:.0f} s (checkpoint build {built_s:.0f} s), peak RSS {peak_rss_gb():.1f} GB")
    (args.out / "memory_table.json").write_text(json.dumps(
        {"rows": rows, "wall_s": round(wall, 1), "build_s": round(built_s, 1), "peak_rss_gb": round(peak_rss_gb(), 2),
         "config": base_cfg.from_config}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
