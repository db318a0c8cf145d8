"""`python -m flows.inspect status|show|path|gc|memory|compare|diff ...` (= `finetune inspect`): the artifact
store read without running anything or importing Prefect; flows/reports/inspect_cli.py."""

import sys

from flows.console import closed_pipe_quiet
from flows.reports.inspect_cli import main

if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
