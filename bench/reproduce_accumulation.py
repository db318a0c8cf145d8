"""The gradient-accumulation article reproduced on CPU: now the `accumulation` sweep of pipeline.yaml (the demo's
all-MiniLM-L6-v2 + LoRA on 1,024 real IMDB reviews; micro-batch 1 x accumulation 1, 1 x 16 and 16 x 1 at the
same learning rate; seeds 1, 2, 3; test accuracy on 1,000 held-out reviews). This script is a thin call of

    python -m flows.sweep accumulation [--parallel 2]        # the runs (each child run in its own process)
    python -m flows.inspect compare --sweep accumulation     # the table, mean ± sd over the seeds

with one torch thread per process (OMP_NUM_THREADS=1: on a shared 2-core machine two threads per process
wait on each other). Runs already in the store are reused; a rerun only prints the table.

    .venv/bin/python bench/reproduce_accumulation.py [--parallel 2]
    .venv/bin/python bench/reproduce_accumulation.py --smoke   # the same 3 variants on tiny-imdb, 1 seed, 2 steps
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from benchlib import parser  # noqa: E402

# the smoke's sweep: the accumulation sweep's variants on tiny-imdb's random model, one seed, two steps each
SMOKE = """\
pipelines:
  tiny-imdb-accumulation:
    extends: tiny-imdb
    data: {subset: {train: 32, validation: 8, test: 8}}
    train: {eval_every: null, select_best: null, max_steps: 2}
sweeps:
  accumulation:
    description: the accumulation sweep's variants on tiny-imdb (bench/reproduce_accumulation.py --smoke)
    pipeline: tiny-imdb-accumulation
    variants:
      - {train.micro_batch_size: 1, train.gradient_accumulation_steps: 1}
      - {train.micro_batch_size: 1, train.gradient_accumulation_steps: 16}
      - {train.micro_batch_size: 16, train.gradient_accumulation_steps: 1}
    seeds: [1]
    metric: test.accuracy
"""


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--parallel", help="child runs at once (flows.sweep's --parallel)")
    p.add_argument("--config", type=Path, help="the pipeline file holding the sweep (default: pipeline.yaml)")
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    from flows.inspect import main as inspect
    from flows.sweep import main as sweep

    if args.smoke:
        args.config = Path(tempfile.mkdtemp(prefix="accumulation-smoke-")) / "accumulation-smoke.yaml"
        args.config.write_text(SMOKE)
    config = ["--config", str(args.config)] if args.config else []
    rc = sweep(["accumulation", *rest, *(["--parallel", args.parallel] if args.parallel else []), *config])
    if rc == 2:  # bad input: nothing ran
        return rc
    inspect(["compare", "--sweep", "accumulation", *config])
    return rc


if __name__ == "__main__":
    sys.exit(main())
