"""`python -m flows.finetune PIPELINE [--set train.lr=1e-4] [--only STAGE] [--until STAGE] [--force STAGE]
[--verify]` (= `finetune run`): the pipeline as a Prefect flow; flows/orchestration/launch.py."""

from __future__ import annotations

import sys

from flows.console import closed_pipe_quiet
from flows.orchestration.launch import run_main


def main(argv: list[str] | None = None, *, prog: str = "python -m flows.finetune") -> int:
    return run_main(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
