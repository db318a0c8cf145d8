"""`python -m flows.predict PIPELINE|EXPORT_FOLDER --text ... | --file ...` (= `finetune predict`): a trained
model on new text, without Prefect; flows/reports/predict_cli.py."""

from __future__ import annotations

import sys

from flows.console import closed_pipe_quiet
from flows.reports import predict_cli


def main(argv: list[str] | None = None, *, prog: str = "python -m flows.predict") -> int:
    return predict_cli.main(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
