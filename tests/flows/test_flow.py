"""The Prefect flow end to end (the worker's Prefect server, tests/conftest.py prefect_server): task states are
`Cached` exactly when the store reused an artifact."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import ROOT, needs_shared_data, subprocess_env
from s3server import free_port

import flows.orchestration  # noqa: F401  (project Prefect defaults)
from stages.engine.store import Store
from stages.graph import GRAPH

pytestmark = needs_shared_data
SMALL = {"data.subset": {"train": 40, "validation": 8, "test": 8}}


def task_states(flow_run_id) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read():
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            return {r.name.rsplit("-", 1)[0]: r.state.name for r in runs}

    return asyncio.run(read())


def test_finetune_run_reaches_a_stage_body_in_seven_project_frames(prefect_server, store_dir, monkeypatch):
    """`finetune run tiny-imdb --until data`, in this process: from the console command to the data stage's
    body the stack holds these project functions and no others (Prefect's own frames between them apart),
    and the pipeline file is read once."""
    from flows import console
    from stages import data
    from stages.engine import config

    chains, loads = [], []
    real_read = config.read_yaml
    monkeypatch.setattr(config, "read_yaml", lambda path: loads.append(path) or real_read(path))
    project = (str(ROOT / "flows"), str(ROOT / "stages"))

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is data.run.__code__:
            chain, f = [], frame
            while f is not None:
                if f.f_code.co_filename.startswith(project):
                    chain.append(f"{Path(f.f_code.co_filename).stem}.{f.f_code.co_qualname}")
                f = f.f_back
            chains.append(chain[::-1])

    sys.setprofile(profile)
    try:
        rc = console.main(["run", "tiny-imdb", "--until", "data", "--force", "data",
                           "--set", "data.subset={train: 40, validation: 8, test: 8}"])
    finally:
        sys.setprofile(None)
    assert rc == 0
    assert chains == [["console.main", "launch.run_main", "finetune_flow.finetune", "finetune_flow.stage_task",
                       "runner.run_step", "store.Store.run", "data.run"]]
    assert loads == [ROOT / "pipeline.yaml"]  # the config is read (and validated, resolved, keyed) once


def test_second_flow_run_is_all_cached(prefect_server, store_dir):
    from flows.orchestration.finetune_flow import finetune

    first = finetune("tiny-imdb", SMALL, until="tokenize", return_state=True)
    assert first.is_completed()
    summary = first.result()
    assert [(s["stage"], s["state"], s["computed"]) for s in summary] == [
        ("data", "Completed", True), ("tokenize", "Completed", True)]
    events = len(Store(store_dir).events())

    second = finetune("tiny-imdb", SMALL, until="tokenize", return_state=True)
    summary2 = second.result()
    assert [(s["stage"], s["state"], s["computed"]) for s in summary2] == [
        ("data", "Cached", False), ("tokenize", "Cached", False)]
    assert task_states(second.state_details.flow_run_id) == {"data": "Cached", "tokenize": "Cached"}
    assert [e["event"] for e in Store(store_dir).events()[events:]] == ["cached", "cached"]

    # a tokenize setting reruns tokenize only; --only/--force through the flow
    third = finetune("tiny-imdb", {**SMALL, "tokenize.max_length": 16}, until="tokenize").copy()
    assert [(s["stage"], s["state"]) for s in third] == [("data", "Cached"), ("tokenize", "Completed")]
    forced = finetune("tiny-imdb", SMALL, only="tokenize", force=["tokenize"])
    assert [(s["stage"], s["state"]) for s in forced] == [("tokenize", "Completed")]


def test_stage_error_fails_the_flow_with_one_line(prefect_server, store_dir, tmp_path):
    from flows.orchestration.finetune_flow import finetune

    state = finetune("tiny-imdb", {"data.source": "local", "data.path": str(tmp_path / "missing.csv")},
                     until="tokenize", return_state=True)
    assert state.is_failed()
    assert "no such file or folder" in state.message
    assert not (store_dir / "data").exists()
    # an unknown stage name fails the flow with run_pipeline's one line, before any stage runs
    bad = finetune("tiny-imdb", SMALL, until="trian", return_state=True)
    assert bad.is_failed() and bad.message.startswith("ConfigError: --until trian: unknown stage (did you mean train?); stages are data,")


def flow_run_logs(flow_run_id) -> list:
    """Every log record the API holds for this flow run (its tasks' too), oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogHandler

    async def read():
        await APILogHandler.aflush()  # the handler sends in batches
        async with get_client() as client:
            return await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                          sort=LogSort.TIMESTAMP_ASC)

    return asyncio.run(read())


def test_stage_log_lines_reach_the_prefect_api(prefect_server, store_dir, monkeypatch):
    """The train stage's step lines, its progress lines (output is not a terminal here) and its final summary
    are task-run logs of the train task in the Prefect API (what the UI shows), not only console output."""
    from flows.orchestration.finetune_flow import finetune

    monkeypatch.setenv("FINETUNE_PROGRESS", "log")
    state = finetune("tiny-imdb", {**SMALL, "train.log_every": 1}, until="train", return_state=True)
    assert state.is_completed(), state.message
    run_id = state.state_details.flow_run_id
    train_task = next(iter(t for t, s in task_states(run_id).items() if t == "train"))
    logs = flow_run_logs(run_id)
    train = [rec.message for rec in logs if rec.name == "finetune.train"]
    steps = [m for m in train if m.startswith("Epoch: 001 | Batch")]
    assert [m.split(" | ")[2] for m in steps] == [f"Step {s:04d}/0005" for s in range(1, 6)], train
    assert any(m.startswith("train:  20% (1/5 steps) | loss ") and "| ETA " in m for m in train), train
    assert any(m.startswith("train: done, 5/5 steps in ") for m in train), train
    assert train[-1].startswith(("train: done", "Epoch: 001 | Step 0005 | validation")), train
    # they belong to the train task run (the UI's task-run logs), and the data stage's lines to data's
    task_ids = {rec.task_run_id for rec in logs if rec.name == "finetune.train"}
    assert len(task_ids) == 1 and None not in task_ids and train_task == "train"
    assert any(rec.name == "finetune.data" and rec.message.startswith("data: ") for rec in logs)
    # the flow's own outcome lines (log_prints) are there too
    assert any(rec.message.lstrip().startswith("train ") and "computed" in rec.message for rec in logs)


TRAINING = [sys.executable, "-m", "flows.finetune", "tiny-imdb", "--set", "train.epochs=1000",
            "--set", "data.subset={train: 32, validation: 8, test: 8}", "--set", "train.log_every=1"]


def start_training(env: dict, fh, log: Path, sigint) -> tuple[subprocess.Popen, int]:
    """`python -m flows.finetune` training for long, in its own session, SIGINT as given: (process, port of its
    temporary Prefect server), once it has done a few steps."""
    p = subprocess.Popen(TRAINING, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    deadline = time.monotonic() + 240
    try:
        while not re.search(r"Step 0002/", log.read_text()):
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    return p, int(re.search(r"temporary server on http://127\.0\.0\.1:(\d+)", log.read_text()).group(1))


@pytest.mark.parametrize(("how", "rc", "line"), [
    ("ctrl-c", 130, "interrupted; committed stages stay in the store"),
    ("sigterm", 143, "terminated; committed stages stay in the store"),
    ("background kill -INT", 130, "interrupted; committed stages stay in the store"),
])
def test_a_stopped_run_crashes_and_stops_its_temporary_server(tmp_path, how, rc, line):
    """`python -m flows.finetune` with no Prefect server configured, stopped while training: by Ctrl-C (a
    terminal sends SIGINT to the whole process group) or by `kill PID` (SIGTERM). The run ends Crashed, the
    process exits within seconds, and the temporary Prefect server it started is stopped with it. Before:
    Ctrl-C also killed the server and the run then hung for minutes retrying the dead API; SIGTERM left the
    server running, orphaned, on its port. Started in a script's background (SIGINT inherited ignored), `kill
    -INT` stops it too. The train stage writes a checkpoint at the step it stopped; `inspect status` says so."""
    env = subprocess_env(tmp_path / "store")
    env.pop("PREFECT_API_URL", None)  # a temporary server, as for a user without one
    log = tmp_path / "out.log"
    with log.open("w") as fh:
        # as in a terminal; `cmd &` in a script starts it with SIGINT ignored
        p, port = start_training(env, fh, log, signal.SIG_IGN if "background" in how else signal.SIG_DFL)
        try:
            stopped_at = time.monotonic()
            if how == "ctrl-c":
                os.killpg(p.pid, signal.SIGINT)
            elif "background" in how:
                p.send_signal(signal.SIGINT)
            else:
                p.send_signal(signal.SIGTERM)
            code = p.wait(timeout=60)
            print(f"{how}: exit {code} after {time.monotonic() - stopped_at:.1f} s")  # shown with pytest -s -n 0
        finally:
            with contextlib.suppress(ProcessLookupError):  # whatever is left in its group
                os.killpg(p.pid, signal.SIGKILL)
    out = log.read_text()
    assert code == rc, out[-3000:]
    assert "Finished in state Crashed" in out and line in out and "See https://" not in out
    # the train stage saved where it stopped: a resume checkpoint of the last finished step
    stop = re.search(r"train: (?:Ctrl-C \(SIGINT\)|SIGTERM) at step (\d+) of \d+: checkpoint (\S+); the next run", out)
    assert stop, out[-3000:]
    assert Path(stop.group(2)).name == f"step-{int(stop.group(1)):06d}" and Path(stop.group(2), "progress.json").is_file()
    status = subprocess.run([sys.executable, "-m", "flows.inspect", "status", *TRAINING[3:]], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert re.search(rf"\ntrain .*\n(    .*\n)*?    resumable from step {stop.group(1)} of \d+ ", status.stdout), status.stdout
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_kill_9_leaves_no_server_and_the_next_run_marks_it_crashed(tmp_path):
    """`kill -9` of `python -m flows.finetune` (started in the background) while training: no exit hook runs,
    yet its temporary Prefect server stops within seconds (it watches its parent), and the next command
    marks the dead run Crashed (it was left Running)."""
    env = subprocess_env(tmp_path / "store", PREFECT_HOME=str(tmp_path / "prefect"))
    env.pop("PREFECT_API_URL", None)
    log = tmp_path / "out.log"
    with log.open("w") as fh:
        p, port = start_training(env, fh, log, signal.SIG_IGN)
        children = psutil.Process(p.pid).children(recursive=True)  # the temporary server among them
        try:
            p.kill()
            assert p.wait(timeout=30) == -signal.SIGKILL
            deadline = time.monotonic() + 20
            while True:  # the server notices within 0.5 s and stops gracefully (5 s at most)
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=2).close()
                except ConnectionRefusedError:
                    break
                assert time.monotonic() < deadline, f"the temporary server still listens on port {port}"
                time.sleep(0.5)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            for child in children:  # whatever outlived it (a server that failed to stop itself)
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
    nxt = subprocess.run([*TRAINING, "--until", "data"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert nxt.returncode == 0, (nxt.stdout + nxt.stderr)[-3000:]
    assert "was left Running by a process that is gone: marked Crashed" in nxt.stdout + nxt.stderr
    # a tiny flow with a temporary server: its start is one line, without Prefect's advice line (TEMPORARY_SERVER_HINT)
    assert "Starting temporary server on http://127.0.0.1:" in nxt.stderr and "See https://" not in nxt.stdout + nxt.stderr


SERVER_GONE = (r"error: the Prefect server at http://127\.0\.0\.1:\d+/api stopped answering at [\d:]+; the run "
               r"stopped before (evaluate|export) \(data, tokenize, model, adapters, train(, evaluate)? are in the "
               r"store\): {how}, which reuses them: ")


def kill_its_server_mid_run(tmp_path: Path, env: dict, kill, then: str = "wait") -> tuple[int, float, str]:
    """A run (80 training steps) whose Prefect server `kill()` kills at step 2; with then="ctrl-c", Ctrl-C once
    the run has seen the server down. (exit code, seconds from the kill to the exit, output)."""
    log = tmp_path / "out.log"
    run = [*TRAINING[:5], "train.epochs=20", *TRAINING[6:]]
    with log.open("w") as fh:
        p = subprocess.Popen(run, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while not re.search(r"Step 0002/", log.read_text()):
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            kill(p)
            killed = time.monotonic()
            if then == "ctrl-c":
                while "does not answer" not in log.read_text():
                    assert time.monotonic() - killed < 30, log.read_text()[-3000:]
                    time.sleep(0.2)
                os.killpg(p.pid, signal.SIGINT)
            code = p.wait(timeout=90)
            took = time.monotonic() - killed
            print(f"{then}: exit {code} {took:.1f} s after the server was killed")  # shown with pytest -s -n 0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    out = log.read_text()
    for noise in ("Traceback", "Error logging to API", "EventsWorker", "Unable to connect"):
        assert noise not in out, out[-3000:]
    assert took < 60, out[-3000:]
    return code, took, out


def committed(store: Path) -> set[str]:
    return {stage for stage, _, _ in Store(store).entries()}


@pytest.mark.parametrize(("then", "rc", "line"), [
    ("wait", 1, SERVER_GONE.format(how=r"rerun \(a new temporary server starts\)")),
    ("ctrl-c", 130, r"interrupted; committed stages stay in the store"),
])
def test_a_prefect_server_killed_mid_run_ends_the_run_with_one_line(tmp_path, then, rc, line):
    """The temporary Prefect server killed (-9) while the run trains. The train stage goes on and commits (the
    store needs no server), then the run stops before evaluate: one line saying so, exit 1, within seconds
    (before: a minute of retries per API call, a traceback, then a hang at exit until Ctrl-C, which printed a
    KeyboardInterrupt traceback and exited 1). Ctrl-C while the server is down: exit 130 and its line at once.
    No traceback and none of Prefect's per-event complaints either way."""
    env = subprocess_env(tmp_path / "store")
    env.pop("PREFECT_API_URL", None)

    def kill(p: subprocess.Popen) -> None:
        next(c for c in psutil.Process(p.pid).children(recursive=True)
             if "server_watch.py" in " ".join(c.cmdline())).kill()

    code, _, out = kill_its_server_mid_run(tmp_path, env, kill, then)
    assert code == rc, out[-3000:]
    assert (found := re.search(line, out)), out[-3000:]
    if then == "wait":  # stopped before evaluate, or (train ended before the kill was seen) before export
        assert committed(tmp_path / "store") == set(GRAPH.names[:GRAPH.names.index(found.group(1))]), out[-3000:]
        assert f"store: {tmp_path / 'store'}" in out
    else:  # stopped in train: a resume checkpoint, nothing of train committed
        assert "train" not in committed(tmp_path / "store")
        assert re.search(r"train: Ctrl-C \(SIGINT\) at step \d+ of \d+: checkpoint", out), out[-3000:]


def test_a_prefect_api_url_server_killed_mid_run_ends_the_run_with_one_line(tmp_path):
    """The same with the server PREFECT_API_URL names (`prefect server start`, killed with its process group):
    the line says to start it again."""
    from cluster import PREFECT, answering, start

    env = subprocess_env(tmp_path / "store", PREFECT_HOME=str(tmp_path / "home"), PREFECT_UI_ENABLED="false",
                         PREFECT_SERVER_ANALYTICS_ENABLED="false")
    port = free_port()
    env["PREFECT_API_URL"] = api = f"http://127.0.0.1:{port}/api"
    server = start([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, tmp_path,
                   tmp_path / "server.log")
    try:
        answering(f"{api}/health", server, tmp_path / "server.log", 300)
        code, _, out = kill_its_server_mid_run(tmp_path, env, lambda p: os.killpg(server.pid, signal.SIGKILL))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert code == 1, out[-3000:]
    assert (found := re.search(SERVER_GONE.format(how="start it again, then rerun"), out)), out[-3000:]
    assert committed(tmp_path / "store") == set(GRAPH.names[:GRAPH.names.index(found.group(1))]), out[-3000:]
