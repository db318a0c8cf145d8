"""`python -m stages PIPELINE [--set K=V] [--only|--until|--force STAGE] [--verify]`: the pipeline's stages
through the store, without Prefect."""

from __future__ import annotations

import sys
from pathlib import Path

from stages.engine.cli import describe, guarded, parser, setup_logging
from stages.engine.config import store_root
from stages.engine.remote_store import open_store
from stages.graph import load_args, precheck, run_pipeline


def main(argv: list[str] | None = None) -> int:
    args = parser("python -m stages").parse_args(argv)

    def go() -> None:
        cfg = load_args(args)
        precheck(cfg, args.only, args.until)  # one line and exit 2 before the store is opened
        setup_logging()
        store = open_store()
        print(f"pipeline {cfg.name} ({Path(__file__).parent}) -> store {store_root()}", flush=True)
        run_pipeline(cfg, store, only=args.only, until=args.until, force=args.force, verify=args.verify,
                     on_outcome=lambda o: print(describe(o), flush=True))

    return guarded(go)


if __name__ == "__main__":
    sys.exit(main())
