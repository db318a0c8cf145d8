"""One Prefect home: the server the README starts (`python -m flows.server`) and the command-line runs
share one database, so a run made by `python -m flows.finetune` appears in that server's API and UI."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
from helpers import ROOT, needs_shared_data, subprocess_env

pytestmark = needs_shared_data


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_command_line_run_appears_in_the_server_the_readme_starts(tmp_path):
    port, home = free_port(), tmp_path / "prefect-home"
    env = subprocess_env(tmp_path / "store", PREFECT_HOME=str(home))
    env.pop("PREFECT_API_URL", None)
    api = f"http://127.0.0.1:{port}/api"
    log = tmp_path / "server.log"
    with log.open("w") as fh:
        server = subprocess.Popen([sys.executable, "-m", "flows.server", "--port", str(port)], cwd=ROOT, env=env,
                                  stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{api}/health", timeout=5).status_code == 200:
                    break
            time.sleep(1)
        assert f"PREFECT_HOME={home}" in log.read_text()
        run = subprocess.run([sys.executable, "-m", "flows.finetune", "tiny-imdb", "--until", "data", "--set",
                              "data.subset={train: 8, validation: 4, test: 4}"], cwd=ROOT,
                             env={**env, "PREFECT_API_URL": api}, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
        assert "temporary server" not in run.stdout + run.stderr  # it used the server, started none
        flow_runs = httpx.post(f"{api}/flow_runs/filter", json={}, timeout=30).json()
        assert [(r["parameters"]["pipeline"], r["state_type"]) for r in flow_runs] == [("tiny-imdb", "COMPLETED")]
        assert (home / "prefect.db").is_file()  # the server's database is in the home the CLI runs use
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
