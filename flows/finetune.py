"""`python -m flows.finetune PIPELINE [--set train.lr=1e-4] [--only STAGE] [--until STAGE] [--force STAGE]
[--verify]` (= `finetune run`): the pipeline as a Prefect flow; flows/orchestration/launch.py."""

import sys

from flows.orchestration.launch import run_main as main

if __name__ == "__main__":
    sys.exit(main())
