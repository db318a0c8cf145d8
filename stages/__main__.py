"""`python -m stages PIPELINE [--set K=V] [--only|--until|--force STAGE] [--verify]`: the pipeline's stages
through the store, without Prefect."""

from __future__ import annotations

import sys
from pathlib import Path

from stages.engine.cli import Lines, parser, setup_logging, user_errors
from stages.engine.config import store_root
from stages.engine.remote_store import open_store
from stages.engine.runner import execute
from stages.graph import plan_args


def main(argv: list[str] | None = None) -> int:
    args = parser("python -m stages").parse_args(argv)
    with user_errors() as failed:
        store = open_store()
        # every check before anything is written: bad input is one line and exit 2, and no store
        plan = plan_args(args, store)
        setup_logging()
        print(f"pipeline {plan.cfg.name} ({Path(__file__).parent}) -> store {store_root()}", flush=True)
        execute(plan, store, hooks=[Lines(lambda line: print(line, flush=True))])
        return 0
    return failed.code


if __name__ == "__main__":
    sys.exit(main())
