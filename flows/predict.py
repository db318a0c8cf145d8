"""`python -m flows.predict PIPELINE|EXPORT_FOLDER --text ... | --file ...` (= `finetune predict`): a trained
model on new text, without Prefect; flows/reports/predict_cli.py."""

import sys

from flows.console import closed_pipe_quiet
from flows.reports.predict_cli import main

if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
