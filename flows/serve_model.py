"""`python -m flows.serve_model PIPELINE|EXPORT_FOLDER ...` (= `finetune serve-model`): exports served in the OpenAI
API's shape with a playground page, without Prefect; flows/reports/serve_model.py."""

import sys

from flows.console import closed_pipe_quiet
from flows.reports.serve_model import main

if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
