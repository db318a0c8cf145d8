"""A real `mlflow server` for the tracking tests (tests/engine/test_tracking.py, the sweep test): sqlite backend,
artifacts proxied into a folder, on a free port of 127.0.0.1, in a session of its own (stopped by its process
group, tests/cluster.py). MLflow's background job runner (huey) is off: the tests use none of its jobs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from cluster import answering, start, stop
from s3server import free_port

MLFLOW = str(Path(sys.executable).with_name("mlflow"))


@contextlib.contextmanager
def mlflow_server(tmp: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """Yields (its URL, its process) once /health answers."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "mlflow-server.log"
    proc = start([MLFLOW, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                  "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--artifacts-destination",
                  str(tmp / "artifacts")], {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, tmp, log)
    try:
        answering(f"{url}/health", proc, log, 120)
        yield url, proc
    finally:
        stop(proc)
