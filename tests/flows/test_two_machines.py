"""Two machines, simulated on one: a real Prefect server, a `process` work pool, two workers (each its own
local cache and work folder) and one shared s3:// store (moto's S3 server). A sweep dispatched to the pool
spreads its variants over both workers, and the stages they share are computed once across them.
docs/two-machines.md is this test's walkthrough, command by command. Every server and worker is started
and stopped here by its PID (process group)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import needs_shared_data
from s3server import free_port

from stages.engine.remote_store import RemoteStore

pytestmark = [needs_shared_data, pytest.mark.cluster]
ROOT = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
POOL = "two-machines"
SMALL = "data.subset={train: 40, validation: 8, test: 8}"
DEPLOY = ("from prefect import deploy; from flows.serve import deployments; "
          f"deploy(*deployments(['tiny-imdb']), work_pool_name='{POOL}', ignore_warnings=True)")


def start(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group: the flow runs it starts go with it


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def prefect_server(env: dict[str, str], tmp: Path) -> Iterator[str]:
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    proc = start([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, tmp,
                 tmp / "server.log")
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{api}/health", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp / "server.log").read_text()
                time.sleep(0.5)
        yield api
    finally:
        stop(proc)


def run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 180) -> str:
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_a_sweep_on_a_work_pool_spreads_over_two_workers_sharing_one_s3_store(s3_endpoint, tmp_path):
    store_url = f"s3://finetune-test/two-machines-{uuid.uuid4().hex[:8]}"
    base = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false",
            "PREFECT_SERVER_LOGGING_LEVEL": "WARNING", "FINETUNE_STORE": store_url,
            "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1", "OMP_NUM_THREADS": "1"}
    with prefect_server(base, tmp_path) as api:
        env = {**base, "PREFECT_API_URL": api}
        run([PREFECT, "work-pool", "create", POOL, "--type", "process"], env, ROOT)
        run([sys.executable, "-c", DEPLOY], env, ROOT)
        workers = []
        try:
            for name in ("a", "b"):  # a machine each: own local cache (artifact copies, checkpoints), own cwd
                (tmp_path / name).mkdir()
                workers.append(start([PREFECT, "worker", "start", "--pool", POOL, "--limit", "1", "--name", name],
                                     {**env, "FINETUNE_CACHE": str(tmp_path / name / "cache")}, tmp_path / name,
                                     tmp_path / name / "worker.log"))
            out = run([sys.executable, "-m", "flows.sweep", "tiny-imdb", "--grid", "train.lr=1e-3,5e-4",
                       "--set", SMALL, "--parallel", "2", "--on-workers"],
                      {**env, "FINETUNE_CACHE": str(tmp_path / "orchestrator")}, ROOT, timeout=240)
        finally:
            for w in workers:
                stop(w)
    assert "2 runs of tiny-imdb" in out
    # each worker trained one variant: its local cache holds one train artifact
    trained = {n: list((tmp_path / n / "cache").glob("*/train/*/manifest.json")) for n in ("a", "b")}
    assert {n: len(v) for n, v in trained.items()} == {"a": 1, "b": 1}, out
    # the shared store saw every stage computed once per key: the variants' common stages once in all
    events = RemoteStore(store_url, cache=tmp_path / "reader").events()
    computed = Counter((e["stage"], e["key"]) for e in events if e["event"] == "computed")
    assert set(computed.values()) == {1}
    per_stage = Counter(stage for stage, _ in computed)
    assert per_stage["train"] == 2 and per_stage["data"] == per_stage["tokenize"] == per_stage["model"] == 1
    cached = {e["stage"] for e in events if e["event"] == "cached"}
    assert {"data", "tokenize", "model"} <= cached  # the second worker took them from the store
