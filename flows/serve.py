"""`python -m flows.serve [PIPELINE ...] [--limit N] [--wait SECONDS]` (= `finetune serve`): one deployment per
pipeline and sweep, served on a Prefect server; flows/orchestration/serving.py."""

from __future__ import annotations

import sys

from flows.console import closed_pipe_quiet
from flows.orchestration import serving


def main(argv: list[str] | None = None, *, prog: str = "python -m flows.serve") -> int:
    return serving.main(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
