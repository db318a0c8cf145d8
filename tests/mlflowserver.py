"""A real `mlflow server` for the tracking tests (tests/engine/test_tracking.py, the sweep test): sqlite backend,
artifacts proxied into a folder, on a free port of 127.0.0.1, in a session of its own (stopped by its process
group). MLflow's background job runner (huey) is off: the tests use none of its jobs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from s3server import free_port

MLFLOW = str(Path(sys.executable).with_name("mlflow"))


@contextlib.contextmanager
def mlflow_server(tmp: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """Yields (its URL, its process) once /health answers."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "mlflow-server.log"
    proc = subprocess.Popen([MLFLOW, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
                             "--artifacts-destination", str(tmp / "artifacts")],
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, cwd=tmp,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.3)
        yield url, proc
    finally:
        kill(proc)


def kill(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
