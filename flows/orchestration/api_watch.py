"""The Prefect server a command-line run reports to (`finetune run`: its temporary server, or PREFECT_API_URL's),
watched while the run lasts, so that a server that dies ends the run with one line instead of a hang.

Before, a dead server cost the run about 62 s of retries per API call (each stage's UI artifact, the flow's
final state), one warning or error per event and per log batch, then a traceback, and the process hung at
exit: Prefect drains its event and log queues at interpreter exit, each item waiting on the dead server,
until Ctrl-C (a KeyboardInterrupt traceback, exit 1).

Now a thread asks the server's /health every POLL_S (any answer counts: only a refused or timed-out request
is "down"). From the first unanswered poll one warning says so and Prefect's per-item complaints are held
back; the stage in progress goes on and commits (the store needs no server). Before each next stage and
after the last one the flow asks `gone()`: a server that has not answered for GRACE_S (a restart takes less)
ends the run there: the run record says failed, one line says what is in the store and how to go on, and the
process exits 1 (`leave`) without going back through Prefect, which could deliver nothing. Ctrl-C or SIGTERM
while the server is down, or once the flow has returned (during Prefect's exit drain), ends the process at
once with exit 130 / 143 and its line, never a traceback (flows/orchestration/signals.py).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from datetime import datetime

import httpx

from flows.orchestration.compat_prefect import (
    api_log_errors_shown,
    quiet_prefect_while,
    stop_temporary_server_now,
)

POLL_S = 1.0
TIMEOUT_S = 2.0
GRACE_S = 10.0  # unanswered this long at a stage boundary: gone (a server restart takes less)
EXIT_CODE = 1  # not the user's input (2): the server it reports to is gone

log = logging.getLogger("finetune.flows")


class ServerWatch:
    def __init__(self, api_url: str):
        self.url = api_url.rstrip("/")
        self.down_since: float | None = None  # the first unanswered poll of the current outage
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True, name="prefect-server-watch")

    def start(self) -> ServerWatch:
        quiet_prefect_while(self.down)
        self._thread.start()
        return self

    def down(self) -> bool:
        return self.down_since is not None

    def since(self) -> str:
        return datetime.fromtimestamp(self.down_since or time.time()).strftime("%H:%M:%S")

    def check(self) -> bool:
        """Ask the server once and record the answer: True when it answers."""
        try:
            httpx.get(f"{self.url}/health", timeout=TIMEOUT_S)
            answered = True
        except httpx.HTTPError:
            answered = False
        with self._lock:
            if answered and self.down_since is not None:
                self.down_since = None
                api_log_errors_shown(True)
                log.warning("the Prefect server at %s answers again", self.url)
            elif not answered and self.down_since is None:
                self.down_since = time.time()
                api_log_errors_shown(False)
                log.warning("the Prefect server at %s does not answer; the stage in progress goes on and is "
                            "committed, and the run stops after it unless the server is back within %.0f s",
                            self.url, GRACE_S)
        return answered

    def _poll(self) -> None:
        while not self._stopped.wait(POLL_S):
            self.check()

    def stop(self) -> None:
        """No more polls (the run is over: its temporary server is about to stop)."""
        self._stopped.set()

    def gone(self) -> bool:
        """At a stage boundary: whether the server is gone (unanswered for GRACE_S). A server that just went
        down is given until then to come back."""
        while not self.check():
            if time.time() - (self.down_since or time.time()) >= GRACE_S:
                return True
            time.sleep(POLL_S)
        return False


_wanted = False
_watch: ServerWatch | None = None
_returned = False


def watch_the_server() -> None:
    """Called by a command line before it starts its flow: the flow then watches the server it runs against
    (a deployment's run, whose process a runner started, does not)."""
    global _wanted
    _wanted = True


def attach(api_url: str | None) -> None:
    """At the flow's start: watch `api_url` (the flow run's client's), once per process."""
    global _watch
    if _wanted and _watch is None and api_url:
        _watch = ServerWatch(api_url).start()


def gone() -> bool:
    """The watched server is gone (waits up to GRACE_S for one that just went down); False when not watching."""
    return _watch is not None and _watch.gone()


def flow_returned() -> None:
    """The flow has returned (or raised): from here on Ctrl-C and SIGTERM need not go through Prefect."""
    global _returned
    _returned = True
    if _watch is not None:
        _watch.stop()


def leave_at_once() -> bool:
    """Whether a stop signal should end the process now (`leave`) rather than unwind through Prefect: the
    server is down (Prefect's crash report would wait on it) or the flow has returned (the exit drain)."""
    return _returned or (_watch is not None and _watch.down())


def exit_now_if_down(code: int) -> int:
    """After the flow: `code`, or, when the server went down since (Prefect's exit drain would wait on it), the
    process ends now with that code."""
    if _watch is not None and not _watch.check():
        leave(code)
    return code


def gone_line(committed: list[str], stopped_before: str | None = None, rerun: str = "", finished: bool = True) -> str:
    """The run's last line when its server is gone: it stopped before a stage, or it ended (every stage
    `finished`, or one failed) and Prefect could not record that."""
    assert _watch is not None
    where = f"the Prefect server at {_watch.url} stopped answering at {_watch.since()}"
    if stopped_before is None:
        done = "every stage finished and is in the store, but " if finished else ""
        return f"{where}; {done}Prefect could not record the run (it stays Running there until the next run marks " \
               f"it Crashed)"
    restart = "start it again, then rerun" if os.environ.get("PREFECT_API_URL") else "rerun (a new temporary " \
        "server starts)"
    kept = f"{', '.join(committed)} {'is' if len(committed) == 1 else 'are'} in the store" if committed else \
        "nothing was committed"
    return f"{where}; the run stopped before {stopped_before} ({kept}): {restart}, which reuses them: {rerun}"


def leave(code: int, *lines: str) -> None:
    """End the process now: `lines` on stderr, the temporary server stopped, no exit hook (Prefect's drain of
    events and logs would wait on a dead server)."""
    for line in lines:  # not print: inside a flow Prefect turns print into a log record
        sys.stderr.write(line + "\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    stop_temporary_server_now()
    os._exit(code)
