"""Machines simulated on one computer, for tests/flows/test_two_machines.py and bench/scale_out.py: a real
Prefect server on a free loopback port (its own PREFECT_HOME), a `process` work pool with finetune
deployments, and workers that each have their own local cache and folder. Every process is started here
in a session of its own and stopped by its PID (its process group: the flow runs a worker started go too)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from s3server import free_port

ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))
POOL = "two-machines"
# A migrated Prefect database for the servers started here (tests/conftest.py names it for the test session): a
# server on a fresh PREFECT_HOME spends ~11 of its ~17 CPU seconds migrating an empty database, so the first
# server to ask migrates this one (`prefect server database upgrade`, under a lock) and each gets a copy.
PREFECT_DB = "FINETUNE_TEST_PREFECT_DB"


def deploy_command(pipelines: list[str], pool: str = POOL) -> list[str]:
    return [sys.executable, "-c", "from prefect import deploy; from flows.orchestration.serving import deployments; "
            f"deploy(*deployments({pipelines!r}), work_pool_name={pool!r}, ignore_warnings=True)"]


def start(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def answering(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Wait until `url` answers; fail with the end of the server's log if it exits or takes over timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """End the process group (sig, then SIGKILL after 20 s)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run(cmd: list[str], env: dict[str, str], cwd: Path = ROOT, timeout: float = 600) -> str:
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def base_env(tmp: Path, store: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(tmp / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false",
            "PREFECT_SERVER_LOGGING_LEVEL": "WARNING", "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "1", "OMP_NUM_THREADS": "1", "FINETUNE_STORE": store}


def migrated_database(home: Path, env: dict[str, str]) -> None:
    """Put a copy of env's FINETUNE_TEST_PREFECT_DB (migrated on first use) in `home` when it has no database yet;
    without that setting (a bench run by hand) the server migrates its own, as Prefect does."""
    if not (template := env.get(PREFECT_DB)) or (home / "prefect.db").exists():
        return
    template_db = Path(template)
    template_db.parent.mkdir(parents=True, exist_ok=True)
    with open(template_db.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other xdist worker waits for the one migrating
        if not template_db.exists():
            building = template_db.parent / "building"
            shutil.rmtree(building, ignore_errors=True)
            run([PREFECT, "server", "database", "upgrade", "-y"],
                {**{k: v for k, v in env.items() if not k.startswith("PREFECT_API_")}, "PREFECT_HOME": str(building)})
            (building / "prefect.db").rename(template_db)  # whole or absent: a crash mid-migration leaves none
    home.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(template_db) as src, sqlite3.connect(home / "prefect.db") as dst:
        src.backup(dst)  # a consistent copy whatever journal mode the migration left


@contextlib.contextmanager
def server(env: dict[str, str], tmp: Path) -> Iterator[str]:
    """`prefect server start` on a free loopback port (its database in env's PREFECT_HOME, a copy of the session's
    migrated one where tests/conftest.py names it), its log in tmp/server.log; yields its API URL once /health
    answers, stops it (by its process group) on exit."""
    if home := env.get("PREFECT_HOME"):
        migrated_database(Path(home), env)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    proc = start([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                 {**env, "PREFECT_API_URL": api, "PREFECT_SERVER_API_HOST": "127.0.0.1",
                  "PREFECT_SERVER_API_PORT": str(port)}, tmp, tmp / "server.log")
    try:
        answering(f"{api}/health", proc, tmp / "server.log", 300)
        yield api
    finally:
        stop(proc)


@contextlib.contextmanager
def orchestrator(env: dict[str, str], tmp: Path, pipelines: list[str], api: str | None = None,
                 pool: str = POOL) -> Iterator[dict[str, str]]:
    """The Prefect server (started here, or the running one at `api`), the pool and the deployments of
    `pipelines`; yields env + PREFECT_API_URL."""
    with contextlib.nullcontext(api) if api else server(env, tmp) as api:
        env = {**env, "PREFECT_API_URL": api}
        run([PREFECT, "work-pool", "create", pool, "--type", "process"], env)
        run(deploy_command(pipelines, pool), env)
        yield env


@contextlib.contextmanager
def machines(env: dict[str, str], tmp: Path, *names: str, pool: str = POOL,
             **extra: str) -> Iterator[dict[str, subprocess.Popen]]:
    """One worker per name on `pool`, each a machine: its own local cache (artifact copies, checkpoints) and
    folder; `extra` added to their environment."""
    workers = {}
    try:
        for name in names:
            (tmp / name).mkdir(parents=True)
            workers[name] = start([PREFECT, "worker", "start", "--pool", pool, "--limit", "1", "--name", name],
                                  {**env, "FINETUNE_CACHE": str(tmp / name / "cache"), **extra}, tmp / name,
                                  tmp / name / "worker.log")
        yield workers
    finally:
        for w in workers.values():
            stop(w)
