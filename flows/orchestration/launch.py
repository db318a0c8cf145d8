"""The command lines that start a flow in this process: `finetune run` (the `finetune` flow) and `finetune
sweep` (the `sweep` flow). The config is validated before Prefect is imported, so bad input costs a second,
prints one line, exits 2 and writes nothing.

    finetune run PIPELINE [--set train.lr=1e-4] [--only STAGE] [--until STAGE] [--force STAGE] [--verify] [--track]
    finetune sweep NAME [--parallel N] [--track]             a sweep of pipeline.yaml's `sweeps:`
    finetune sweep PIPELINE --grid train.lr=1e-4,5e-4 [--grid KEY=V1,V2 ...] [--set KEY=VALUE ...]
                            [--seeds 1,2,3] [--metric test.accuracy] [--mode max] [--parallel N]

A sweep runs one child `finetune` flow run per variant and seed through the same store: stages whose key the
variants share (data, tokenize, model, adapters when only train.* varies) are computed once; then it prints
the command that compares them. Exit 1 when a run of the sweep failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from flows.reports.variants import add_sweep_args, compare_hint, from_args, save_definition, spec
from stages.engine.cli import add_track_option, guarded, parser, setup_logging, user_errors
from stages.engine.config import store_root, sweep_names
from stages.engine.errors import ConfigError
from stages.engine.remote_store import open_store
from stages.engine.runner import check_store_writable
from stages.graph import plan_args
from stages.pipeline.tracking import TRACK_ENV


def run_main(argv: list[str] | None = None, default_pipeline: str | None = None,
             prog: str = "python -m flows.finetune") -> int:
    args = parser(prog, default_pipeline).parse_args(argv)
    with user_errors() as failed:
        # the plan: config, data, inputs, hub checked and every key computed, before Prefect starts
        store = open_store()
        plan = plan_args(args, store)
        check_store_writable(plan, store, note=False)  # one that cannot be written: refused before Prefect starts
        # no logging setup of ours: Prefect's console handler shows the stage lines (stage_logs.py)
        from prefect.utilities.annotations import quote

        from flows.orchestration import api_watch
        from flows.orchestration.finetune_flow import finetune  # imports Prefect: the config is good
        from flows.orchestration.signals import stop_cleanly_on_signals

        stop_cleanly_on_signals()
        api_watch.watch_the_server()
        try:
            state = finetune(args.pipeline, args.overrides, args.only, args.force, args.verify, args.until,
                             str(args.config), quote(plan), return_state=True)  # quoted: the engine walks no plan
        except Exception:  # the server went down after the last stage: Prefect's final call failed
            if api_watch.gone():
                api_watch.leave(api_watch.EXIT_CODE, f"error: {api_watch.gone_line([], finished=False)}",
                                f"store: {store_root()}")
            raise
        finally:
            api_watch.flow_returned()
        if state.is_failed():
            print(f"error: {state.message}", file=sys.stderr)
            return api_watch.exit_now_if_down(2)
        print(f"store: {store_root()}")
        return api_watch.exit_now_if_down(0)
    return failed.code


def sweep_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run a sweep of pipeline variants through the "
                                "store, keyed by each stage's inputs; shared stages are computed once.")
    p.add_argument("target", metavar="NAME|PIPELINE", help="a sweep of pipeline.yaml (sweeps:), or with --grid "
                   "a pipeline to sweep ad hoc")
    add_sweep_args(p)
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="child runs at once (default 1); each "
                   "runs in its own process")
    add_track_option(p)
    p.add_argument("--on-workers", action="store_true", help="run each child as a run of the finetune/<pipeline> "
                   "deployment, picked up by a work pool's workers (needs PREFECT_API_URL; docs/two-machines.md)")
    return p


def sweep_main(argv: list[str] | None = None, prog: str = "python -m flows.sweep") -> int:
    args = sweep_parser(prog).parse_args(argv)

    def go() -> int:
        if args.parallel < 1:
            raise ConfigError(f"--parallel {args.parallel}: must be >= 1")
        if args.track:  # every run of the sweep (each child inherits it) and the sweep's parent run
            os.environ[TRACK_ENV] = "1"
        sw = from_args(args, args.target)  # every run's config validated before Prefect starts
        setup_logging()
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per API call otherwise
        from flows.orchestration.signals import stop_cleanly_on_signals
        from flows.orchestration.sweep_flow import run_sweep  # imports Prefect: the sweep is good

        stop_cleanly_on_signals()
        named = not (args.grid or args.seeds) and args.target in sweep_names(args.config)
        if not named:
            save_definition(sw, open_store())  # `compare --sweep NAME` finds it there
        print(f"sweep {sw.name}; compare it with: {compare_hint(sw)}", flush=True)
        state = run_sweep(sw.name, args.parallel, str(sw.config_file), None if named else spec(sw),
                          on_workers=args.on_workers, return_state=True)
        print(f"store: {store_root()}\ncompare: {compare_hint(sw)}")
        if state.is_failed():
            print(f"error: {state.message}", file=sys.stderr)
            return 1
        return 0

    return guarded(go)
