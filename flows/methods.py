"""`python -m flows.methods [--config FILE]` (= `finetune methods`): the training methods, what each learns, its
head and the pipelines that use it; flows/reports/methods_cli.py."""

import sys

from flows.console import closed_pipe_quiet
from flows.reports.methods_cli import main

if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
