"""Every workaround of Prefect behaviour in one place, each with the Prefect versions it was written for and the
target it relies on (tests/flows/test_compat_prefect.py fails when the pinned version leaves a range or a
target is gone: re-check the workaround against the new Prefect, then widen its range).

Only this module touches Prefect internals (private attributes, replaced module globals); the rest of
flows/orchestration/ calls the functions below.
"""

from __future__ import annotations

import asyncio
import fcntl
import importlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Workaround:
    name: str
    versions: str  # a PEP 440 specifier: the Prefect versions it was written for and checked against
    module: str  # where the target lives
    attributes: tuple[str, ...]  # what must exist there (a dotted path from the module)
    why: str

    def missing(self) -> list[str]:
        """The target's attributes that the installed Prefect lacks."""
        try:
            obj: Any = importlib.import_module(self.module)
        except ImportError:
            return [self.module]
        out = []
        for dotted in self.attributes:
            value = obj
            for part in dotted.split("."):
                value = getattr(value, part, _MISSING)
                if value is _MISSING:
                    out.append(f"{self.module}.{dotted}")
                    break
        return out


_MISSING = object()

SERVER_OWN_SESSION = Workaround(
    "temporary server in its own session", ">=3.9,<3.10", "prefect.server.api.server",
    ("subprocess", "SubprocessASGIServer._run_uvicorn_command"),
    "Ctrl-C reaches the terminal's whole foreground process group: the temporary server died before the run "
    "and the run hung for minutes retrying a dead API. Prefect has no option to start it elsewhere, so the "
    "module's `subprocess` is replaced by one whose Popen starts a new session, and runs the server (`python "
    "-m uvicorn`, as _run_uvicorn_command builds it) under server_watch.py, so that it dies with its command.")

RUNNER_STOP = Workaround(
    "serve's runner stopped from our signal handler", ">=3.9,<3.10", "prefect.runner",
    ("Runner.handle_sigterm", "Runner.execute_in_background", "Runner.astop", "Runner.start"),
    "Runner.start installs handle_sigterm for SIGTERM and its graceful stop has no deadline; flows.serve "
    "overrides it and reads the runner's private state (started, stopping, _loop, _process_manager) to stop "
    "within seconds and kill what is left.")

RUNNER_PROCESSES = Workaround(
    "the runner's flow-run processes", ">=3.9,<3.10", "prefect.runner._process_manager",
    ("ProcessManager.flow_run_ids", "ProcessManager.get"),
    "the pids of the flow runs in progress, to kill them when the graceful stop overruns (no public API).")

ENGINE_TRACEBACK = Workaround(
    "a user error's second traceback", ">=3.9,<3.10", "prefect.flow_engine", ("_engine_logger",),
    "after a flow ends Failed on a user error, the engine logs it again at ERROR with a full traceback on the "
    "`prefect.engine` / `prefect.flow_runs` loggers; flows/orchestration/stage_logs.py lowers that record.")

TASK_RUN_NAMES = Workaround(
    "task-run names are format strings", ">=3.9,<3.10", "prefect.tasks", ("Task.with_options",),
    "Prefect formats a task-run name with the task's parameters, so braces in a variant's label are doubled.")

CHILD_FLOW_RUN_LINK = Workaround(
    "a child flow run linked to a task run", ">=3.9,<3.10", "prefect.client.orchestration",
    ("SyncPrefectClient.read_task_run", "SyncPrefectClient.create_flow_run"),
    "the API records a task run from its events a moment after the task starts; a flow run linked to it "
    "before then is refused (foreign key), so the sweep waits for the task run to be readable.")

TEMPORARY_SERVER_HINT = Workaround(
    "the temporary server's advice line", ">=3.9,<3.10", "prefect.server.api.server",
    ("subprocess_server_logger", "SubprocessASGIServer.start"),
    "every run without PREFECT_API_URL logged `Starting temporary server on URL` plus a second line, `See "
    "https://www.prefect.io/docs/v3/concepts/server#how-to-guides for more information on running a dedicated "
    "Prefect server.`, in one INFO record with no setting to turn it off; the README and docs/deployments.md "
    "say how to run a server (`finetune server`), so a filter on that logger keeps the first line only.")

FIRST_START = Workaround(
    "one first start per Prefect home", ">=3.9,<3.10", "prefect.server.api.server",
    ("_memoize_block_auto_registration",),
    "commands started at once on a fresh PREFECT_HOME each start a temporary server, and each server migrates "
    "the database and registers Prefect's block types at start: the concurrent first starts raced (sqlite "
    "IntegrityError on block_schema, tracebacks in two of three runs). server_watch.py does both once, under a "
    "file lock in the home, before its server starts; registration goes through the server's own memo "
    "(_memoize_block_auto_registration), so the server then skips it.")

CANCELLED_BY_RUNNER = Workaround(
    "a run its runner cancels 'Finished in state Running()'", ">=3.9,<3.10", "prefect.flow_engine",
    ("FlowRunEngine.handle_cancellation", "FlowRunEngine._engine_owns_cancellation_handling"),
    "a deployment run stopped by `finetune serve` (its runner cancels it with SIGTERM) logs `Flow run was "
    "cancelled.` and then `Finished in state Running()`: the runner, not the engine, sets Cancelled a moment "
    "later, so the engine's last line names a state the run never finishes in. A filter on the flow-run logger "
    "rewrites that one line to say who sets the final state.")

DEAD_SERVER_NOISE = Workaround(
    "a dead server's complaints, once per event and log batch", ">=3.9,<3.10", "prefect.logging.handlers",
    ("APILogWorker._handle_batch",),
    "with the API unreachable, every event logged a warning (`Unable to connect to 'ws://.../events/in'`) and an "
    "error (`Service 'EventsWorker' failed to process item Event(...)`, the whole event), and every log batch "
    "wrote `--- Error logging to API ---` straight to stderr (only when logging.raiseExceptions is on). While "
    "the run's server watch (flows/orchestration/api_watch.py) finds the server down, filters on those two "
    "loggers drop them and raiseExceptions is off; the watch says it once.")

TEMPORARY_SERVER_STOP = Workaround(
    "the temporary server stopped from a quick exit", ">=3.9,<3.10", "prefect.server.api.server",
    ("SubprocessASGIServer._instances",),
    "a run that ends with os._exit (its server gone, or Ctrl-C during Prefect's exit drain) runs no exit hook, "
    "so not the one that stops the temporary server; api_watch.leave stops it through Prefect's registry of "
    "started servers (server_watch.py would stop a live one within seconds anyway, not a hung one).")

EXIT_DRAIN = Workaround(
    "the exit drain that waits on a dead server", ">=3.9,<3.10", "prefect._internal.concurrency.services",
    ("_QueueServiceBase._at_exit", "_QueueServiceBase.drain"),
    "Prefect drains its event and log queues at interpreter exit (threading._register_atexit), each item "
    "retried against the server: with the server gone the process hung there until Ctrl-C, whose "
    "KeyboardInterrupt then printed a traceback and exited 1. A run that knows its server is gone, or is "
    "stopped during that drain, ends with os._exit instead (api_watch.leave).")

FAILED_STATE_TRACEBACK = Workaround(
    "a failed state's empty traceback", ">=3.9,<3.10", "prefect.task_engine", ("SyncTaskRunEngine.handle_retry",),
    "a task that returns a Failed state (a stage's one-line user error) is logged `Task run failed with state: "
    "Failed(...)` with exc_info=True and no exception being handled, so the line was followed by a stray "
    "`NoneType: None`; a filter on the task-run logger drops that empty exc_info (a real exception keeps its "
    "traceback).")

WORKAROUNDS = (SERVER_OWN_SESSION, RUNNER_STOP, RUNNER_PROCESSES, ENGINE_TRACEBACK, TASK_RUN_NAMES,
               CHILD_FLOW_RUN_LINK, TEMPORARY_SERVER_HINT, FIRST_START, CANCELLED_BY_RUNNER, DEAD_SERVER_NOISE,
               TEMPORARY_SERVER_STOP, EXIT_DRAIN, FAILED_STATE_TRACEBACK)

# the loggers on which the engine logs a failed run's exception (ENGINE_TRACEBACK)
ENGINE_LOGGERS = ("prefect.flow_runs", "prefect.engine")


SERVER_WATCH = Path(__file__).with_name("server_watch.py")


class _ServerInOwnSession:
    """`subprocess` as Prefect's temporary-server module sees it: the same, except that Popen starts the server
    in a session of its own, watching this process (server_watch.py: it stops when this process is gone,
    `kill -9` included)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(*args: Any, **kwargs: Any) -> subprocess.Popen:  # noqa: N802  (the name it replaces)
        cmd = list(kwargs.pop("args", None) or args[0])
        if cmd[1:3] == ["-m", "uvicorn"]:  # the server (Prefect runs `python -m uvicorn ...`)
            cmd = [cmd[0], str(SERVER_WATCH), str(os.getpid()), *cmd[2:]]
        return subprocess.Popen(cmd, *args[1:], **{**kwargs, "start_new_session": True})


def start_temporary_server_in_own_session() -> None:
    """SERVER_OWN_SESSION: the temporary server Prefect starts for a run without PREFECT_API_URL gets a session
    of its own, so Ctrl-C reaches the run only; the run stops the server on exit."""
    import prefect.server.api.server as temporary_server

    temporary_server.subprocess = _ServerInOwnSession()


def prepare_database_once() -> None:
    """FIRST_START: the database migrated and the block types registered for this Prefect version, by one
    process at a time per home (a marker file records it; the lock's holder does it, the others find it done)."""
    import prefect
    from prefect.server.api.server import _memoize_block_auto_registration
    from prefect.server.database import provide_database_interface
    from prefect.server.models.block_registration import run_block_auto_registration
    from prefect.settings import PREFECT_HOME

    home = Path(PREFECT_HOME.value())
    done = home / f".prepared-{prefect.__version__}"
    if done.exists():
        return

    @_memoize_block_auto_registration
    async def register_blocks() -> None:
        db = provide_database_interface()
        async with await db.session() as session:
            await run_block_auto_registration(session=session)

    async def prepare() -> None:
        await provide_database_interface().create_db()
        await register_blocks()

    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".prepare.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another start preparing: wait for it, then find it done
        if not done.exists():
            asyncio.run(prepare())
            done.touch()


class _FirstLineOfServerStart(logging.Filter):
    """TEMPORARY_SERVER_HINT: `Starting temporary server on URL`, without the advice line after it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Starting temporary server on "):
            record.msg = record.msg.split("\n", 1)[0]
        return True


def quiet_temporary_server_hint() -> None:
    """TEMPORARY_SERVER_HINT (idempotent): a filter on the logger the temporary server's start is logged on."""
    import prefect.server.api.server as temporary_server

    logger = temporary_server.subprocess_server_logger
    if not any(isinstance(f, _FirstLineOfServerStart) for f in logger.filters):
        logger.addFilter(_FirstLineOfServerStart())


RUNNING_AT_FINISH = "Finished in state Running()"
CANCELLED_LINE = "Finished: cancelled by its runner, which sets the state Cancelled"


class _CancelledByRunner(logging.Filter):
    """CANCELLED_BY_RUNNER: the engine's closing line of a run its runner cancelled (the line after the engine's
    `Flow run was cancelled.`), rewritten."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Flow run was cancelled.":
            self.cancelled = True
        elif record.msg == RUNNING_AT_FINISH and self.cancelled:
            record.msg, record.args = CANCELLED_LINE, ()
        return True


def say_who_cancelled() -> None:
    """CANCELLED_BY_RUNNER (idempotent): a filter on the logger the flow engine's closing line is logged on."""
    logger = logging.getLogger("prefect.flow_runs")
    if not any(isinstance(f, _CancelledByRunner) for f in logger.filters):
        logger.addFilter(_CancelledByRunner())


class _NoEmptyTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[0] is None:
            record.exc_info = None
        return True


def no_empty_tracebacks() -> None:
    """FAILED_STATE_TRACEBACK (idempotent): a filter on the task-run logger."""
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, _NoEmptyTraceback) for f in logger.filters):
        logger.addFilter(_NoEmptyTraceback())


# DEAD_SERVER_NOISE: (logger, how its complaint about an unreachable API starts)
DEAD_SERVER_COMPLAINTS = (("prefect.events.clients", "Unable to connect to"),
                          ("prefect._internal.concurrency", "Service %r failed to process item"))


class _WhileDown(logging.Filter):
    def __init__(self, down: Callable[[], bool], starts: str):
        super().__init__()
        self.down, self.starts = down, starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.starts) and self.down())


def quiet_prefect_while(down: Callable[[], bool]) -> None:
    """DEAD_SERVER_NOISE: while down(), Prefect's complaint per event about an unreachable API is dropped."""
    for name, starts in DEAD_SERVER_COMPLAINTS:
        logging.getLogger(name).addFilter(_WhileDown(down, starts))


def api_log_errors_shown(shown: bool) -> None:
    """DEAD_SERVER_NOISE: Prefect's log worker writes `--- Error logging to API ---` per failed batch only
    while logging.raiseExceptions is on (the standard library's switch for handler errors)."""
    logging.raiseExceptions = shown


def stop_temporary_server_now() -> None:
    """TEMPORARY_SERVER_STOP: the temporary servers this process started, stopped (SIGTERM, then SIGKILL after
    2 s: a hung server ignores the first)."""
    started = sys.modules.get("prefect.server.api.server")  # not imported: no temporary server (and no 1 s import)
    for server in list(started.SubprocessASGIServer._instances.values()) if started else []:
        proc = getattr(server, "server_process", None)
        if proc is None or proc.poll() is not None:
            continue
        proc.terminate()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()


def runner_with_sigterm_handler(on_sigterm: Any, **runner_kwargs: Any) -> Any:
    """RUNNER_STOP: a prefect.runner.Runner whose SIGTERM handler (installed by Runner.start) is on_sigterm."""
    from prefect.runner import Runner

    class ServeRunner(Runner):
        def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:
            on_sigterm()

    return ServeRunner(**runner_kwargs)


def runner_is_serving(runner: Any) -> bool:
    """RUNNER_STOP: the runner has started and its event loop runs (a graceful stop can be scheduled on it)."""
    return runner is not None and getattr(runner, "started", False) and getattr(runner, "_loop", None) is not None


def stop_runner_in_background(runner: Any) -> None:
    """RUNNER_STOP: start the graceful stop (cancel runs, stop polling, pause deployments) from a signal
    handler, as Runner.handle_sigterm does."""
    runner.stopping = True
    runner.execute_in_background(runner.astop)


def runner_processes(runner: Any) -> list[tuple[str, int]]:
    """RUNNER_PROCESSES: (flow run id, pid) of the runner's flow-run processes still tracked (alive or not yet
    reaped); none when the runner has no process manager (yet)."""
    manager: Any = getattr(runner, "_process_manager", None)
    out = []
    try:
        for flow_run_id in manager.flow_run_ids():
            handle = manager.get(flow_run_id)
            if handle is not None and handle.pid:
                out.append((str(flow_run_id), handle.pid))
    except Exception:  # noqa: BLE001  (best effort: called while stopping)
        return out
    return out


def literal_task_run_name(label: str) -> str:
    """TASK_RUN_NAMES: a task-run name Prefect shows as given (`subset={train:4096}` keeps its braces)."""
    return label.replace("{", "{{").replace("}", "}}")


def wait_for_task_run(client: Any, task_run_id: Any, timeout_s: float = 60) -> None:
    """CHILD_FLOW_RUN_LINK: return once the API can read the task run a child flow run will be linked to."""
    import time

    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.read_task_run(task_run_id)
            return
        except ObjectNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
