"""`python -m flows.summary PIPELINE [--set ...] [--if-cached]` (= `finetune summary`): what a pipeline's
artifacts in the store amount to, without Prefect; flows/reports/run_summary.py."""

from __future__ import annotations

import sys

from flows.console import closed_pipe_quiet
from flows.reports import run_summary


def main(argv: list[str] | None = None, *, prog: str = "python -m flows.summary") -> int:
    return run_summary.main(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
