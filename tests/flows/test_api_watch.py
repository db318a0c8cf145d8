"""The run's watch on its Prefect server (flows/orchestration/api_watch.py), against a real HTTP server on
loopback that stops and comes back: any answer is "up", a refused connection is "down", and a server is gone
only once it has stayed down for the grace period."""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from helpers import ROOT

from flows.orchestration import api_watch


@contextlib.contextmanager
def http_server(port: int = 0, status: int = 200) -> Iterator[int]:
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802  (the stdlib's name)
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_stops_is_down_at_once_and_gone_after_the_grace_period(monkeypatch, caplog):
    monkeypatch.setattr(api_watch, "GRACE_S", 1.0)
    monkeypatch.setattr(api_watch, "POLL_S", 0.1)
    monkeypatch.setattr(logging, "raiseExceptions", True)
    with http_server(status=401) as port:  # a server that wants credentials still answers
        watch = api_watch.ServerWatch(f"http://127.0.0.1:{port}/api/")
        assert watch.check() and not watch.down() and not watch.gone()
    with caplog.at_level(logging.WARNING, "finetune.flows"):
        assert not watch.check() and watch.down()
        assert not logging.raiseExceptions  # Prefect's per-batch "Error logging to API" held back while down
        t0 = time.monotonic()
        assert watch.gone()
        assert time.monotonic() - t0 < 1.5
        with http_server(port):  # back (a restart): up again, and said so
            assert not watch.gone() and not watch.down() and logging.raiseExceptions
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"the Prefect server at http://127.0.0.1:{port}/api does not answer; the stage in progress goes "
                    f"on and is committed, and the run stops after it unless the server is back within 1 s",
                    f"the Prefect server at http://127.0.0.1:{port}/api answers again"]


def test_a_server_back_within_the_grace_period_is_not_gone(monkeypatch):
    monkeypatch.setattr(api_watch, "GRACE_S", 5.0)
    monkeypatch.setattr(api_watch, "POLL_S", 0.1)
    with http_server() as port:
        watch = api_watch.ServerWatch(f"http://127.0.0.1:{port}/api")
    assert not watch.check()
    restarted = threading.Timer(0.5, lambda: stack.enter_context(http_server(port)))
    with contextlib.ExitStack() as stack:
        restarted.start()
        assert not watch.gone()  # waited for it
        restarted.join()


@pytest.mark.parametrize(("committed", "before", "url_set", "expected"), [
    (["data", "tokenize"], "model", False, "; the run stopped before model (data, tokenize are in the store): rerun "
                                           "(a new temporary server starts), which reuses them: CMD"),
    (["data"], "tokenize", True, "; the run stopped before tokenize (data is in the store): start it again, then "
                                 "rerun, which reuses them: CMD"),
    ([], None, False, "; every stage finished and is in the store, but Prefect could not record the run (it stays "
                      "Running there until the next run marks it Crashed)"),
])
def test_the_last_line_says_what_is_in_the_store_and_how_to_go_on(monkeypatch, committed, before, url_set, expected):
    watch = api_watch.ServerWatch("http://127.0.0.1:9/api")
    watch.down_since = time.time()
    monkeypatch.setattr(api_watch, "_watch", watch)
    if url_set:
        monkeypatch.setenv("PREFECT_API_URL", watch.url)
    else:
        monkeypatch.delenv("PREFECT_API_URL", raising=False)
    line = api_watch.gone_line(committed, before, "CMD")
    assert line == f"the Prefect server at http://127.0.0.1:9/api stopped answering at {watch.since()}{expected}"


# A process whose flow has returned and that now waits at exit the way Prefect's drain of events and logs does
# (a threading exit hook, before the interpreter's atexit hooks), e.g. on a server that stopped answering.
DRAINING = """
import sys, threading, time
from flows.orchestration import api_watch
from flows.orchestration.signals import stop_cleanly_on_signals
stop_cleanly_on_signals()
api_watch.flow_returned()
threading._register_atexit(lambda: time.sleep(60))
print("draining", flush=True)
"""


@pytest.mark.parametrize(("sig", "rc", "line"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_or_sigterm_during_the_exit_drain_is_its_exit_code_and_one_line(sig, rc, line):
    p = subprocess.Popen([sys.executable, "-c", DRAINING], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "draining\n"
        time.sleep(0.5)  # in the exit hook
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == rc and err == f"{line}; committed stages stay in the store, the next run resumes from them\n"
