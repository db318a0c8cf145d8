"""`python -m flows.finetune PIPELINE [--set train.lr=1e-4] [--only STAGE] [--until STAGE] [--force STAGE]
[--verify]` (= `finetune run`): the pipeline as a Prefect flow; flows/orchestration/launch.py."""

import sys

from flows.console import closed_pipe_quiet
from flows.orchestration.launch import run_main as main

if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
