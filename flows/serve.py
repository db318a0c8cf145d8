"""`python -m flows.serve [PIPELINE ...] [--limit N] [--wait SECONDS]` (= `finetune serve`): one deployment per
pipeline and sweep, served on a Prefect server; flows/orchestration/serving.py."""

import sys

from flows.console import closed_pipe_quiet
from flows.orchestration.serving import main

if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
