"""`python -m flows.inspect status|show|path|gc|memory|compare|diff ...` (= `finetune inspect`): the artifact
store read without running anything or importing Prefect; flows/reports/inspect_cli.py."""

from __future__ import annotations

import sys

from flows.console import closed_pipe_quiet
from flows.reports import inspect_cli


def main(argv: list[str] | None = None, *, prog: str = "python -m flows.inspect") -> int:
    return inspect_cli.main(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
