"""The gradient-accumulation article reproduced on CPU: now the `accumulation` sweep of pipeline.yaml (the demo's
all-MiniLM-L6-v2 + LoRA on 1,024 real IMDB reviews; micro-batch 1 x accumulation 1, 1 x 16 and 16 x 1 at the
same learning rate; seeds 1, 2, 3; test accuracy on 1,000 held-out reviews). This script is a thin call of

    python -m flows.sweep accumulation [--parallel 2]        # the runs (each child run in its own process)
    python -m flows.inspect compare --sweep accumulation     # the table, mean ± sd over the seeds

with one torch thread per process (OMP_NUM_THREADS=1: on a shared 2-core machine two threads per process
wait on each other). Runs already in the store are reused; a rerun only prints the table.

    .venv/bin/python bench/reproduce_accumulation.py [--parallel 2]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from flows.inspect import main as inspect  # noqa: E402
from flows.sweep import main as sweep  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    rc = sweep(["accumulation", *(sys.argv[1:] if argv is None else argv)])
    if rc == 2:  # bad input: nothing ran
        return rc
    inspect(["compare", "--sweep", "accumulation"])
    return rc


if __name__ == "__main__":
    sys.exit(main())
