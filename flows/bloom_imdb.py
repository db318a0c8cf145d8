"""`python -m flows.bloom_imdb [--set KEY=VALUE] [--only STAGE] [--force STAGE]` (= `finetune run bloom-imdb`): the
bloom-imdb pipeline as a Prefect flow."""

from __future__ import annotations

import sys

from flows.console import closed_pipe_quiet
from flows.orchestration.launch import run_main


def main(argv: list[str] | None = None, *, prog: str = "python -m flows.bloom_imdb") -> int:
    return run_main(argv, default_pipeline="bloom-imdb", prog=prog)


if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
