"""`python -m flows.finetune PIPELINE [--set train.lr=1e-4] [--only STAGE] [--force STAGE] [--verify]`: the
pipeline as a Prefect flow (flows/flow.py); also the entry point of `python -m flows.bloom_imdb|qlora_t5`.
The config is validated before Prefect is imported, so bad input costs a second, prints one line, exits 2
and writes nothing."""

from __future__ import annotations

import sys

from stages.engine.cli import guarded, parser
from stages.engine.config import store_root
from stages.graph import load_args, precheck


def main(default_pipeline: str | None = None, argv: list[str] | None = None) -> int:
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    args = parser(f"python -m {spec.name}" if spec else "finetune", default_pipeline).parse_args(argv)

    def go() -> int:
        precheck(load_args(args), args.only, args.until)  # config, data, inputs, hub: before Prefect starts
        # no logging setup of ours: Prefect's console handler shows the stage lines (flows/__init__.py)
        # imports Prefect: only once the config is known to be good
        from flows.flow import finetune, stop_cleanly_on_signals

        stop_cleanly_on_signals()
        state = finetune(args.pipeline, args.overrides, args.only, args.force, args.verify, args.until,
                         str(args.config), return_state=True)
        if state.is_failed():
            print(f"error: {state.message}", file=sys.stderr)
            return 2
        print(f"store: {store_root()}")
        return 0

    return guarded(go)


if __name__ == "__main__":
    sys.exit(main())
