"""Run a sweep: variants of a pipeline through the same store, one child `finetune` flow run per variant
and seed (flows/sweep_flow.py), then the comparison (`python -m flows.inspect compare`).

    python -m flows.sweep NAME [--parallel N]                       a sweep of pipeline.yaml's `sweeps:`
    python -m flows.sweep PIPELINE --grid train.lr=1e-4,5e-4 [--grid KEY=V1,V2 ...] [--set KEY=VALUE ...]
                                   [--seeds 1,2,3] [--metric test.accuracy] [--mode max] [--parallel N]

Stages whose key the variants share (data, tokenize, model, adapters when only train.* varies) are computed
once. Every variant's config is validated before Prefect is imported: bad input is one line, exit 2,
nothing written. Exit 1 when a run failed.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from flows.variants import Sweep, adhoc, spec, sweep
from stages.engine.cli import guarded, setup_logging
from stages.engine.config import DEFAULT_PIPELINE_FILE, pipeline_names, store_root, sweep_names
from stages.engine.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flows.sweep", description="Run a sweep of pipeline variants "
                                "through the content-addressed store; shared stages are computed once.")
    p.add_argument("target", metavar="NAME|PIPELINE", help="a sweep of pipeline.yaml (sweeps:), or with --grid "
                   "a pipeline to sweep ad hoc")
    add_adhoc_args(p)
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="child runs at once (default 1); each "
                   "runs in its own process")
    p.add_argument("--on-workers", action="store_true", help="run each child as a run of the finetune/<pipeline> "
                   "deployment, picked up by a work pool's workers (needs PREFECT_API_URL; docs/two-machines.md)")
    return p


def add_adhoc_args(p: argparse.ArgumentParser) -> None:
    """The options that define an ad-hoc sweep (shared with `python -m flows.inspect compare`)."""
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="a dotted key and its values (repeatable; the product is taken), e.g. --grid train.lr=1e-4,5e-4")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every variant of an ad-hoc sweep (repeatable)")
    p.add_argument("--seeds", type=_seeds, default=None, metavar="S1,S2", help="repeat each variant per seed "
                   "(train.seed)")
    p.add_argument("--metric", help="SPLIT.METRIC that ranks variants (default test.accuracy)")
    p.add_argument("--mode", choices=["max", "min"], help="max (default) or min")
    p.add_argument("--name", help="an ad-hoc sweep's name (its folder and UI key); default PIPELINE-<hash>")
    p.add_argument("--config", type=Path, default=DEFAULT_PIPELINE_FILE, help="pipeline file")


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: write integers separated by commas, e.g. 1,2,3") from None


def resolve(args: argparse.Namespace, target: str) -> Sweep:
    """A named sweep, or (with --grid/--seeds) an ad-hoc sweep of the pipeline `target`."""
    if args.grid or args.seeds:
        return adhoc(target, args.grid, args.overrides, args.seeds, args.metric, args.mode, args.name, args.config)
    extra = [o for o, v in (("--set", args.overrides), ("--metric", args.metric), ("--mode", args.mode),
                            ("--name", args.name)) if v]
    if extra:
        raise ConfigError(f"{', '.join(extra)}: only for an ad-hoc sweep (PIPELINE --grid ...); a named sweep "
                          f"takes its settings from pipeline.yaml")
    if target in pipeline_names(args.config) and target not in sweep_names(args.config):
        raise ConfigError(f"{target} is a pipeline, not a sweep: give --grid KEY=V1,V2 to sweep it, or a sweep "
                          f"name ({', '.join(sweep_names(args.config)) or 'none defined under sweeps:'})")
    return sweep(target, args.config)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def go() -> int:
        if args.parallel < 1:
            raise ConfigError(f"--parallel {args.parallel}: must be >= 1")
        sw = resolve(args, args.target)  # every run's config validated before Prefect starts
        setup_logging()
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per API call otherwise
        from flows.flow import stop_cleanly_on_signals
        from flows.sweep_flow import run_sweep  # imports Prefect: only once the sweep is known to be good

        stop_cleanly_on_signals()
        named = not (args.grid or args.seeds)
        state = run_sweep(sw.name, args.parallel, str(args.config), None if named else spec(sw),
                          on_workers=args.on_workers, return_state=True)
        adhoc_args = [sw.config.pipeline, *(a for g in args.grid for a in ("--grid", g)),
                      *(a for o in args.overrides for a in ("--set", o)),
                      *(["--seeds", ",".join(map(str, args.seeds))] if args.seeds else []),
                      *(["--metric", args.metric] if args.metric else []), *(["--mode", args.mode] if args.mode else [])]
        print(f"store: {store_root()}\ncompare: python -m flows.inspect compare "
              + (f"--sweep {sw.name}" if named else shlex.join(adhoc_args)))
        if state.is_failed():
            print(f"error: {state.message}", file=sys.stderr)
            return 1
        return 0

    return guarded(go)


if __name__ == "__main__":
    sys.exit(main())
