"""Ctrl-C and SIGTERM during `finetune run` / `finetune sweep` (a run started without a Prefect server)."""

from __future__ import annotations

import signal
import sys

from flows.orchestration.compat_prefect import start_temporary_server_in_own_session
from stages.engine.cli import RESUME_NOTE


def stop_cleanly_on_signals() -> None:
    """Ctrl-C and SIGTERM (`kill`, a job scheduler, a container stop) end a run started without a Prefect server
    within seconds, its flow run marked Crashed and the temporary Prefect server stopped with it.

    - Ctrl-C: a terminal sends SIGINT to its whole foreground process group, and Prefect starts the temporary
      server in that group, so the server died first and the run then hung for minutes retrying a dead API.
      The server now starts in a session of its own; this process stops it on exit.
    - SIGTERM: with the default handler the process died at once, leaving the server running, orphaned, on its
      port. Prefect's engine marks the run Crashed and then re-sends the signal to the handler that was there
      before the flow started: this one, installed before it, which exits through SystemExit(143) so that the
      exit hooks stop the server."""
    from prefect.settings import get_current_settings

    if get_current_settings().api.url is None:  # no server configured: Prefect will start a temporary one
        start_temporary_server_in_own_session()

    def _exit(signum: int, frame: object) -> None:
        print(f"terminated; {RESUME_NOTE}", file=sys.stderr)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
