"""`python -m flows.summary PIPELINE [--set ...] [--if-cached]` (= `finetune summary`): what a pipeline's
artifacts in the store amount to, without Prefect; flows/reports/run_summary.py."""

import sys

from flows.console import closed_pipe_quiet
from flows.reports.run_summary import main

if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
