"""Where log lines go under Prefect: the stage loggers (`finetune.*`) to the console and the Prefect UI, and a
user error's second traceback from Prefect's engine down to DEBUG. Both installed by `route_logs()`, which
each flow calls first thing (the flow-run process of a deployment or of a sweep's child included)."""

from __future__ import annotations

import logging

from flows.orchestration.compat_prefect import ENGINE_LOGGERS, no_empty_tracebacks, say_who_cancelled
from stages.engine.errors import FinetuneError


class InPrefectRun(logging.Filter):
    """Only records made inside a flow or task run go to the API: a stage run outside any flow in a process
    that also runs flows (a test session, a sweep) logs to the console alone, instead of Prefect warning
    that it has no flow run to send to."""

    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.context import FlowRunContext, TaskRunContext

        return TaskRunContext.get() is not None or FlowRunContext.get() is not None


def send_stage_logs_to_prefect() -> None:
    """The `finetune` logger at INFO (see flows/orchestration/prefect_env.py for why) with Prefect's API
    handler (task-run logs in the UI), only for records made in a run; by propagation the lines also reach
    Prefect's console handler on the root logger. Idempotent; replaces the handler
    PREFECT_LOGGING_EXTRA_LOGGERS=finetune would have added (no line twice)."""
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
    for name in ENGINE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, UserErrorTracebackToDebug) for f in logger.filters):
            logger.addFilter(UserErrorTracebackToDebug())


def route_logs() -> None:
    """Idempotent: every flow calls it when it starts."""
    send_stage_logs_to_prefect()
    quiet_user_error_tracebacks()
    say_who_cancelled()
    no_empty_tracebacks()
