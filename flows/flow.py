"""The `finetune` flow: one Prefect task per stage of a named pipeline, each run through the
content-addressed store. A stage whose key is already committed finishes in state `Cached` without
running its body. Tasks pass artifact paths and manifests, never models or data.

Importing this module runs flows/__init__.py first, which sets the project's Prefect defaults.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NONE
from prefect.states import Completed, Failed, State

from flows.artifacts import publish
from flows.run_owner import claim_and_reap, current_flow_run_id
from stages.engine.cli import describe, terminated
from stages.engine.config import DEFAULT_PIPELINE_FILE, load_pipeline
from stages.engine.errors import FinetuneError
from stages.engine.remote_store import open_store
from stages.engine.runner import Planned, run_stage
from stages.engine.schema import PipelineConfig
from stages.engine.store import Outcome, Store
from stages.graph import run_pipeline, stage_names


def run_one(cfg: PipelineConfig, item: Planned, store: Store, done: dict[str, Outcome], force: bool,
            verify: bool) -> Outcome | State:
    try:
        outcome = run_stage(cfg, item, store, done, force=force, verify=verify)
    except FinetuneError as e:  # a user error: one line in the log and the UI, no traceback
        return Failed(message=f"{type(e).__name__}: {e}", data=e)
    publish(cfg.name, outcome)
    if not outcome.computed:
        return Completed(name="Cached", message=f"store hit {outcome.key[:12]}", data=outcome)
    return outcome


# log_prints off in the stage tasks: stage bodies log, they do not print, and with Prefect's print patch a
# library that captures its own output (dill disassembling a function for `datasets`' fingerprints, under
# the evaluate stage's `evaluate` modules) would spill it into the run's logs
STAGE_TASKS = {name: task(name=name, cache_policy=NONE, log_prints=False)(run_one) for name in stage_names()}


class InPrefectRun(logging.Filter):
    """Only records made inside a flow or task run go to the API: a stage run outside any flow in a process
    that also runs flows (a test session, a sweep) logs to the console alone, instead of Prefect warning
    that it has no flow run to send to."""

    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.context import FlowRunContext, TaskRunContext

        return TaskRunContext.get() is not None or FlowRunContext.get() is not None


def send_stage_logs_to_prefect() -> None:
    """The `finetune` logger at INFO (see flows/__init__.py for why) with Prefect's API handler (task-run
    logs in the UI), only for records made in a run. In every process that imports this module: the
    deployment's flow-run process, a test session that imported Prefect first. Idempotent; replaces the
    handler PREFECT_LOGGING_EXTRA_LOGGERS=finetune would have added (no line twice)."""
    from prefect.logging.handlers import APILogHandler

    stage_log = logging.getLogger("finetune")
    if stage_log.level == logging.NOTSET:
        stage_log.setLevel(logging.INFO)
    ours = [h for h in stage_log.handlers if any(isinstance(f, InPrefectRun) for f in h.filters)]
    for handler in stage_log.handlers[:]:
        if isinstance(handler, APILogHandler) and handler not in ours:
            stage_log.removeHandler(handler)
    if not ours:
        handler = APILogHandler()
        handler.addFilter(InPrefectRun())
        stage_log.addHandler(handler)


SERVER_WATCH = Path(__file__).with_name("server_watch.py")


class _ServerInOwnSession:
    """`subprocess` as Prefect's temporary-server module sees it: the same, except that Popen starts the server
    in a session of its own, watching this process (flows/server_watch.py)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(*args: Any, **kwargs: Any) -> subprocess.Popen:  # noqa: N802  (the name it replaces)
        cmd = list(kwargs.pop("args", None) or args[0])
        if cmd[1:3] == ["-m", "uvicorn"]:  # the server: stopped with this process, even by kill -9
            cmd = [cmd[0], str(SERVER_WATCH), str(os.getpid()), *cmd[2:]]
        return subprocess.Popen(cmd, *args[1:], **{**kwargs, "start_new_session": True})


def stop_cleanly_on_signals() -> None:
    """Ctrl-C and SIGTERM (`kill`, a job scheduler, a container stop) end a run started without a Prefect server
    within seconds, its flow run marked Crashed and the temporary Prefect server stopped with it.

    - Ctrl-C: a terminal sends SIGINT to its whole foreground process group, and Prefect starts the temporary
      server in that group, so the server died first and the run then hung for minutes retrying a dead API.
      The server now starts in a session of its own; this process stops it on exit.
    - SIGTERM: with the default handler the process died at once, leaving the server running, orphaned, on its
      port. Prefect's engine marks the run Crashed and then re-sends the signal to the handler that was there
      before the flow started: this one, installed before it, which exits through SystemExit(143) so that the
      exit hooks stop the server.
    - kill -9: nothing of this process runs; the server watches it and stops itself (flows/server_watch.py),
      and the next flow run marks the run Crashed (flows/run_owner.py)."""
    from prefect.settings import get_current_settings

    if get_current_settings().api.url is None:  # no server configured: Prefect will start a temporary one
        import prefect.server.api.server as temporary_server

        temporary_server.subprocess = _ServerInOwnSession()  # type: ignore[assignment]

    signal.signal(signal.SIGTERM, terminated)


class UserErrorTracebackToDebug(logging.Filter):
    """A run that fails on a user error (a FinetuneError: bad config, missing input) says so in one line,
    its final state ("Finished in state Failed('MissingInputError: ...')"); Prefect's engine then logs the
    same error again at ERROR with a full traceback ("Engine execution exited with unexpected exception"),
    in serve's console and the UI. That record is logged at DEBUG instead (shown with PREFECT_LOGGING_LEVEL
    =DEBUG). Anything else, any other exception, passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno < logging.ERROR or not isinstance(exc, FinetuneError):
            return True
        logging.getLogger(record.name).debug(record.getMessage(), exc_info=record.exc_info)
        return False


def quiet_user_error_tracebacks() -> None:
    for name in ("prefect.flow_runs", "prefect.engine"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, UserErrorTracebackToDebug) for f in logger.filters):
            logger.addFilter(UserErrorTracebackToDebug())


send_stage_logs_to_prefect()
quiet_user_error_tracebacks()


class _StageFailed(Exception):
    """A stage's task ended Failed: stops run_pipeline; the flow returns its message as a Failed state."""


@flow(name="finetune", log_prints=True)
def finetune(pipeline: str, overrides: dict[str, Any] | list[str] | None = None, only: str | None = None,
             force: list[str] | None = None, verify: bool = False, until: str | None = None,
             config: str | None = None) -> list[dict[str, Any]] | State:
    """Run a named pipeline of pipeline.yaml (or `config`). overrides: {"train.lr": 1e-4} or ["train.lr=1e-4"]."""
    cfg = load_pipeline(pipeline, overrides, config or DEFAULT_PIPELINE_FILE)
    claim_and_reap(current_flow_run_id())
    states: dict[str, State] = {}

    def run_task(cfg: PipelineConfig, item: Planned, store: Store, done: dict[str, Outcome], *, force: bool,
                 verify: bool) -> Outcome:
        name = item.stage.name
        state = STAGE_TASKS[name](cfg, item, store, done, force, verify, return_state=True)
        states[name] = state
        if state.is_failed():
            raise _StageFailed(f"stage {name}: {state.message}")
        return state.result()

    try:
        outcomes = run_pipeline(cfg, open_store(), only=only, until=until, force=force or [], verify=verify,
                                run=run_task, on_outcome=lambda o: print(describe(o)))
    except _StageFailed as e:
        return Failed(message=str(e))
    except FinetuneError as e:  # an unknown stage name, --only without its upstream: one line, as a stage's
        return Failed(message=f"{type(e).__name__}: {e}", data=e)
    return [{"stage": o.stage, "key": o.key, "path": str(o.path), "computed": o.computed,
             "state": states[o.stage].name, "duration_s": o.manifest.get("duration_s")} for o in outcomes]
