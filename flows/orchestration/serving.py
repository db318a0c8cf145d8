"""`finetune serve` (`python -m flows.serve`): the `finetune` flow served on a Prefect server: one deployment per pipeline of pipeline.yaml, named
`finetune/<pipeline>`, whose runs execute in this process's machine (one at a time: one GPU); and the
`sweep` flow, one deployment per sweep of the file, `sweep/<name>`.

    prefect server start --host 127.0.0.1                   # 1. the API and UI: http://127.0.0.1:4200
    finetune serve [--config FILE]                          # 2. this: registers and serves the deployments
    prefect deployment run finetune/bloom-imdb --watch      # 3. a run; parameters with -p:
        -p 'overrides={"train.lr": 1e-4}'  -p only=train  -p 'force=["train"]'  -p until=tokenize  -p verify=true

With --config FILE (a user's pipeline file, see stages/engine/config.py) the default is the file's own pipelines
and sweeps, and every deployment's parameters carry the file (`config`, its absolute path), so its runs read it.

PREFECT_API_URL, when not set, defaults to http://127.0.0.1:4200/api. Ctrl-C or SIGTERM stops serving
(a run in progress is cancelled; committed stages stay in the store and the next run reuses them).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

from flows.orchestration.serve_stop import serve_until_stopped
from flows.orchestration.stage_logs import route_logs
from flows.reports.variants import named_sweep
from stages.engine.cli import add_config_option, guarded
from stages.engine.config import (
    DEFAULT_PIPELINE_FILE,
    is_project_file,
    own_names,
    pipeline_names,
    store_root,
    sweep_names,
)
from stages.engine.errors import ConfigError, FinetuneError
from stages.pipeline.loading import load_pipeline

DEFAULT_API_URL = "http://127.0.0.1:4200/api"


class ServerUnreachableError(FinetuneError):
    """No Prefect server answers at PREFECT_API_URL."""


def wait_for_server(api_url: str, wait_s: float) -> None:
    import httpx

    deadline = time.monotonic() + wait_s
    while True:
        try:
            if httpx.get(f"{api_url.rstrip('/')}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            raise ServerUnreachableError(
                f"no Prefect server answers at {api_url}; start one with `prefect server start --host 127.0.0.1` "
                f"or set PREFECT_API_URL (waited {wait_s:.0f} s; --wait SECONDS to wait longer)")
        time.sleep(1)


def deployments(names: list[str], config: Path = DEFAULT_PIPELINE_FILE):
    """One RunnerDeployment per pipeline; entrypoint flows.orchestration.finetune_flow.finetune (module path,
    so the run subprocess imports the project package, not a copy of the file)."""
    from prefect.deployments.runner import EntrypointType

    from flows.orchestration.finetune_flow import finetune

    sweeps = set(sweep_names(config))
    out = sweep_deployments([n for n in names if n in sweeps], config)
    for name in [n for n in names if n not in sweeps]:
        cfg = load_pipeline(name, None, config)  # a broken pipeline fails here, before serving anything
        out.append(finetune.to_deployment(
            name=name,
            parameters={"pipeline": name, **config_parameter(config)},
            description=cfg.description or f"the {name} pipeline of {config.name}",
            tags=["finetune", name],
            entrypoint_type=EntrypointType.MODULE_PATH,
        ))
    return out


def config_parameter(config: Path) -> dict[str, str]:
    """{"config": FILE (absolute)} for a user's pipeline file; {} for the project's (a run reads its own)."""
    return {} if is_project_file(config) else {"config": str(Path(config).resolve())}


def sweep_deployments(names: list[str], config: Path = DEFAULT_PIPELINE_FILE):
    """One RunnerDeployment per sweep of pipeline.yaml, `sweep/<name>` (flows/orchestration/sweep_flow.py); its child runs
    execute beside it, or with `-p on_workers=true` as runs of the `finetune/<pipeline>` deployment, which a
    work pool's workers pick up."""
    from prefect.deployments.runner import EntrypointType

    from flows.orchestration.sweep_flow import run_sweep

    out = []
    for name in names:
        sw = named_sweep(name, config)  # a broken sweep (or one of its variants) fails here, before serving anything
        out.append(run_sweep.to_deployment(
            name=name,
            parameters={"name": name, **config_parameter(config)},
            description=sw.config.description or f"the {name} sweep of {config.name}",
            tags=["sweep", name],
            entrypoint_type=EntrypointType.MODULE_PATH,
        ))
    return out


def main(argv: list[str] | None = None, prog: str = "python -m flows.serve") -> int:
    p = argparse.ArgumentParser(prog=prog, description="Serve one `finetune/<pipeline>` "
                                "deployment per pipeline of pipeline.yaml on a Prefect server.")
    p.add_argument("pipelines", nargs="*", help="pipelines (and sweeps) to serve (default: every pipeline and "
                   "sweep in the file)")
    p.add_argument("--limit", type=int, default=1, help="flow runs at once (default 1: one GPU)")
    add_config_option(p)
    p.add_argument("--wait", type=float, default=10, metavar="SECONDS",
                   help="how long to wait for the Prefect server to answer (default 10)")
    args = p.parse_args(argv)

    def go() -> int:
        if args.limit < 1:
            raise ConfigError(f"--limit {args.limit}: must be >= 1 (flow runs at once)")
        if not 0 <= args.wait < math.inf:
            raise ConfigError(f"--wait {args.wait:g}: must be a finite number of seconds >= 0")
        # Until serving starts, Ctrl-C and SIGTERM raise KeyboardInterrupt; then serve_stop.py stops serving within
        # seconds. SIGINT explicitly: started in a non-interactive shell's background it is inherited ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _interrupt)
        available = pipeline_names(args.config) + sweep_names(args.config)
        unknown = [n for n in args.pipelines if n not in available]
        if unknown:
            raise ConfigError(f"unknown pipeline(s) {', '.join(unknown)}; available: {', '.join(available)}")
        # a file of the user's: its own pipelines and sweeps; all of them when it has none (defaults only)
        names = args.pipelines or (available if is_project_file(args.config) else
                                   own_names(args.config) or available)
        try:
            return serve_deployments(names, args)
        except KeyboardInterrupt:
            print("flows.serve: stopped", flush=True)
            return 0

    return guarded(go)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve_deployments(names: list[str], args: argparse.Namespace) -> int:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api_url = PREFECT_API_URL.value()
    if api_url:  # from the environment or the active profile
        ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    else:  # a local `prefect server start`, never an ephemeral server nobody else can reach
        api_url = os.environ["PREFECT_API_URL"] = DEFAULT_API_URL  # (flow-run subprocesses inherit it)
        ctx = temporary_settings({PREFECT_API_URL: api_url})
    with ctx:
        wait_for_server(api_url, args.wait)
        route_logs()
        deps = deployments(names, args.config)
        print(f"serving {len(deps)} deployments on {api_url} (UI: {api_url.removesuffix('/api')}); "
              f"store {store_root()}; Ctrl-C to stop", flush=True)
        serve_until_stopped(deps, args.limit, api_url)  # returns on Ctrl-C / SIGTERM
    print("flows.serve: stopped", flush=True)
    return 0

