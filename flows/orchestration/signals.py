"""Ctrl-C and SIGTERM during `finetune run` / `finetune sweep` (a run started without a Prefect server)."""

from __future__ import annotations

import signal
from types import FrameType

from flows.orchestration import api_watch
from flows.orchestration.compat_prefect import (
    quiet_temporary_server_hint,
    start_temporary_server_in_own_session,
)
from stages.engine.cli import RESUME_NOTE, terminated


def _stop(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C: KeyboardInterrupt, SIGTERM: exit 143, both through Prefect (which marks the run Crashed); but
    when that cannot finish (the server is down, api_watch) or is over (the flow returned: Prefect's exit
    drain), the process ends at once with its line and 130 / 143."""
    if api_watch.leave_at_once():
        what = "interrupted" if signum == signal.SIGINT else "terminated"
        api_watch.leave(128 + signum, f"{what}; {RESUME_NOTE}")
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    terminated(signum, frame)


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
    - the server gone (api_watch.py), or the flow over and Prefect draining its queues at exit: Ctrl-C and
      SIGTERM end the process at once, exit 130 / 143 and their line, no traceback.
    - kill -9: nothing of this process runs; the server watches it and stops itself (server_watch.py), and
      the next flow run marks the dead run Crashed (run_owner.py).
    SIGINT ignored (a script's `cmd &`) is restored by stages.engine.cli.guarded."""
    from prefect.settings import get_current_settings

    if get_current_settings().api.url is None:  # no server configured: Prefect will start a temporary one
        start_temporary_server_in_own_session()
        quiet_temporary_server_hint()

    signal.signal(signal.SIGTERM, _stop)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _stop)
