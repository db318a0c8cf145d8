"""An S3 API on 127.0.0.1 for tests: moto's standalone server (what s3fs's own suite runs), started and
stopped by PID, with boto's standard settings (AWS_ENDPOINT_URL, dummy credentials) pointing at it.

It serves one request at a time. `python -m moto.server` answers each request in a thread, and its
conditional put checks whether the key exists and then writes it, two steps without a lock
(moto/s3/responses.py, put_object), so two concurrent `If-None-Match: *` creates could both pass. S3
itself decides conditional writes on a key one at a time; a single-threaded moto does the same. A test that
stops a client (SIGSTOP), perhaps in the middle of a request, asks for a threaded one (`threaded=True`): a
single-threaded server would wait on that client's request and serve no other."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

SERVE = """
import sys
from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
run_simple("127.0.0.1", int(sys.argv[1]), DomainDispatcherApplication(create_backend_app),
           threaded=sys.argv[2] == "threaded", request_handler=MotoRequestHandler)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_env(endpoint: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def moto_server(threaded: bool = False) -> Iterator[str]:
    """Yield the endpoint URL of a fresh moto server; the server is killed (by its PID) on exit."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(port), "threaded" if threaded else "one"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start on {endpoint}") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
