"""Ctrl-C and SIGTERM during `finetune run` / `finetune sweep` (a run started without a Prefect server)."""

from __future__ import annotations

import signal

from flows.orchestration.compat_prefect import (
    quiet_temporary_server_hint,
    start_temporary_server_in_own_session,
)
from stages.engine.cli import terminated


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
    - kill -9: nothing of this process runs; the server watches it and stops itself (server_watch.py), and
      the next flow run marks the dead run Crashed (run_owner.py).
    SIGINT ignored (a script's `cmd &`) is restored by stages.engine.cli.guarded."""
    from prefect.settings import get_current_settings

    if get_current_settings().api.url is None:  # no server configured: Prefect will start a temporary one
        start_temporary_server_in_own_session()
        quiet_temporary_server_hint()

    signal.signal(signal.SIGTERM, terminated)
