"""Deployments end to end: a real `prefect server start` on 127.0.0.1 (the worker's, tests/conftest.py), the serve
module, `prefect deployment run ... --watch`; the store and the Prefect API are checked afterwards.
Every process is started in its own process group and stopped by pid, also when a test fails."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from helpers import ROOT, needs_shared_data

from stages.engine.config import pipeline_names
from stages.engine.store import Store

PIPELINE = "tiny-imdb"
SMALL = {"data.subset": {"train": 40, "validation": 8, "test": 8}}
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child in its own process group, its output in a file; stop() ends the group by the child's pid."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logdir: Path):
        self.name, self.log = name, logdir / f"{name}.log"
        self.fh = open(self.log, "w")
        self.p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self.fh, stderr=subprocess.STDOUT,
                                  start_new_session=True)

    def output(self) -> str:
        self.fh.flush()
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 20) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.p.poll() is None:
                os.killpg(self.p.pid, signal.SIGTERM)
                try:
                    self.p.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
            os.killpg(self.p.pid, signal.SIGKILL)  # any flow-run subprocess left in the group
        self.p.wait(10)
        self.fh.close()


def wait_until(what: str, check, timeout: float, proc: Proc | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if result := check():
                return result
        if proc is not None and proc.p.poll() is not None:
            pytest.fail(f"{proc.name} exited ({proc.p.returncode}) while waiting for {what}:\n{proc.output()[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}" +
                (f"; {proc.name} said:\n{proc.output()[-3000:]}" if proc else ""))


@pytest.fixture(scope="module")
def server(prefect_server, tmp_path_factory):
    """The worker's Prefect server (tests/conftest.py: a real `prefect server start`, API only) with this
    module's own Prefect home and store for the processes it starts."""
    root = tmp_path_factory.mktemp("prefect")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(root / "home"), PREFECT_API_URL=prefect_server, PREFECT_SERVER_ANALYTICS_ENABLED="false",
               DO_NOT_TRACK="1", PREFECT_RUNNER_POLL_FREQUENCY="1", PREFECT_LOGGING_LEVEL="INFO", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", FINETUNE_STORE=str(root / "store"))
    return {"api": prefect_server, "env": env, "root": root, "store": root / "store"}


def api_post(server, path: str, body: dict) -> list[dict]:
    r = httpx.post(f"{server['api']}/{path}", json=body, timeout=30)
    r.raise_for_status()
    return r.json()


def start_serve(server, name: str) -> Proc:
    """Start the serve module; return once the server lists every deployment as polled by it (READY)."""
    started = datetime.now(UTC)
    proc = Proc(name, [sys.executable, "-m", "flows.serve", "--wait", "60"], server["env"], server["root"])
    expected = {f"finetune/{n}" for n in pipeline_names()}

    def polled():
        flows_by_id = {f["id"]: f["name"] for f in api_post(server, "flows/filter", {})}
        ready = {f"{flows_by_id.get(d['flow_id'])}/{d['name']}" for d in api_post(server, "deployments/filter", {})
                 if d.get("status") == "READY" and d.get("last_polled")
                 and datetime.fromisoformat(d["last_polled"].replace("Z", "+00:00")) >= started}
        return ready >= expected

    try:
        wait_until("the runner to poll every deployment", polled, 120, proc)
    except BaseException:
        proc.stop()
        raise
    return proc


def deployment_run(server, *params: str) -> tuple[str, str]:
    """`prefect deployment run finetune/tiny-imdb -p ... --watch`; returns (flow run id, output)."""
    res = subprocess.run([str(BIN / "prefect"), "deployment", "run", f"finetune/{PIPELINE}", *params, "--watch",
                          "--watch-timeout", "300"], cwd=ROOT, env=server["env"], capture_output=True, text=True,
                         timeout=330, start_new_session=True)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", out)
    assert run_id, out
    return run_id.group(1), out


def task_states(server, flow_run_id: str) -> dict[str, str]:
    runs = api_post(server, "task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    return {r["name"].rsplit("-", 1)[0]: r["state"]["name"] for r in runs}


@needs_shared_data
def test_deployment_runs_on_a_local_server(server):
    serve = start_serve(server, "serve")
    try:
        t0 = time.monotonic()
        run_id, out = deployment_run(server, "-p", f"overrides={json.dumps(SMALL)}")
        first_s = time.monotonic() - t0
        assert "Completed" in out
        flow_run = httpx.get(f"{server['api']}/flow_runs/{run_id}", timeout=30).json()
        assert flow_run["state"]["type"] == "COMPLETED"
        assert flow_run["parameters"]["pipeline"] == PIPELINE

        # the store holds every stage's artifact, valid
        store = Store(server["store"])
        refs = store.refs(PIPELINE)
        stages = list(task_states(server, run_id))
        assert set(refs) == set(stages) and {"data", "tokenize", "train"} <= set(refs)
        for stage, key in refs.items():
            assert store.problems(stage, key) == [], stage

        # the Prefect API lists one artifact per stage under its stable key
        arts = api_post(server, "artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})
        keys = {a["key"] for a in arts}
        assert {f"{PIPELINE}-{s}" for s in stages} <= keys
        table = next(a for a in arts if a["key"] == f"{PIPELINE}-train" and a["type"] == "table")
        rows = json.loads(table["data"]) if isinstance(table["data"], str) else table["data"]
        assert {"field": "status", "value": "computed"} in rows
        loss = next(a for a in arts if a["key"] == f"{PIPELINE}-train-loss")
        assert loss["type"] == "markdown" and "| step | loss |" in loss["data"]
        for extra in ("evaluate-metrics", "export-files"):  # evaluate's and export's extra artifacts
            assert f"{PIPELINE}-{extra}" in keys, keys

        # a second run: every stage task is Cached, nothing recomputed
        events = len(store.events())
        t0 = time.monotonic()
        run2, _ = deployment_run(server, "-p", f"overrides={json.dumps(SMALL)}")
        second_s = time.monotonic() - t0
        assert task_states(server, run2) == dict.fromkeys(stages, "Cached")
        assert {e["event"] for e in store.events()[events:]} == {"cached"}
        # a store hit uploads no artifact; the stable keys keep the computed run's
        assert api_post(server, "artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run2]}}}) == []
        print(f"first run {first_s:.1f} s, second (cached) run {second_s:.1f} s")

        # SIGTERM (`kill PID`) stops serving cleanly (Ctrl-C: the two tests below)
        os.kill(serve.p.pid, signal.SIGTERM)
        assert serve.p.wait(60) == 0, serve.output()[-3000:]
        assert "flows.serve: stopped" in serve.output() and "Traceback" not in serve.output()
    finally:
        serve.stop()


def test_unreachable_server_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "home"), PREFECT_API_URL=f"http://127.0.0.1:{free_port()}/api")
    res = subprocess.run([sys.executable, "-m", "flows.serve", "--wait", "0"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.startswith("error: no Prefect server answers at") and "Traceback" not in res.stderr


@pytest.mark.parametrize("argv, message", [
    (["--wait", "-5"], "--wait -5: must be a finite number of seconds >= 0"),
    (["--wait", "nan"], "--wait nan: must be a finite number of seconds >= 0"),
    (["--limit", "0"], "--limit 0: must be >= 1 (flow runs at once)"),
], ids=["negative-wait", "nan-wait", "zero-limit"])
def test_a_bad_wait_or_limit_is_one_line_exit_2_before_any_server_is_asked(argv, message, capsys, monkeypatch):
    from flows.orchestration import serving

    monkeypatch.setattr(serving, "wait_for_server", lambda *a: pytest.fail("asked the server"))
    assert serving.main(argv) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_a_user_file_of_defaults_alone_serves_every_pipeline_and_sweep(tmp_path, monkeypatch):
    """A file of sweeps serves those; one of defaults alone has none of its own: every pipeline and sweep, which
    its defaults change."""
    from flows.orchestration import serving
    from stages.engine.config import sweep_names

    served: list[list[str]] = []
    monkeypatch.setattr(serving, "serve_deployments", lambda names, args: served.append(names) or 0)
    monkeypatch.setattr(serving.signal, "signal", lambda *a: None)  # the test process keeps its handlers
    path = tmp_path / "mine.yaml"
    path.write_text("sweeps:\n  my-lrs:\n    pipeline: tiny-imdb\n    grid: {train.lr: [1.0e-3, 1.0e-2]}\n")
    assert serving.main(["--config", str(path)]) == 0 and served == [["my-lrs"]]
    path.write_text("defaults:\n  train: {weight_decay: 0.02}\n")
    assert serving.main(["--config", str(path)]) == 0 and served[1] == pipeline_names() + sweep_names()


def test_artifact_builders(tmp_path):
    """What the train / evaluate / export extras put in the UI, from a manifest and its folder."""
    from flows.orchestration.ui_artifacts import (
        evaluate_rows,
        export_rows,
        manifest_rows,
        train_loss_markdown,
    )
    from stages.engine.store import Outcome

    folder = tmp_path / "train" / ("a" * 64)
    folder.mkdir(parents=True)
    recs = [{"kind": "train", "step": s, "loss": 1 / s} for s in range(1, 101)]
    recs.append({"kind": "validation", "step": 100, "val_loss": 0.02, "val_accuracy": 0.9})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + "not json\n")
    manifest = {"files": [{"path": "metrics.jsonl", "size": 10}, {"path": "trained/model.safetensors", "size": 5}],
                "duration_s": 1.5, "finished_at": "2026-01-01T00:00:00+00:00",
                "metrics": {"steps": 100, "final_loss": 0.01, "validation": [recs[-1]]}}
    o = Outcome("train", "a" * 64, folder, True, "computed", manifest)
    md = train_loss_markdown(o, "metrics.jsonl", max_rows=20)
    table = [ln for ln in md.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert 20 <= len(table) <= 21 and table[-1] == "| 100 | 0.01 | 0.02 | 0.9 |"
    assert "final_loss = 0.01" in md and "data:image" not in md  # no loss.png: no image
    assert train_loss_markdown(Outcome("train", "b", tmp_path, False, "cached", {}), "metrics.jsonl") is None

    rows = manifest_rows(o)
    assert {"field": "size_bytes", "value": 15} in rows and {"field": "final_loss", "value": 0.01} in rows

    splits = {"test": {"accuracy": 0.8, "confusion_matrix": [[1, 2], [3, 4]]}, "validation": {"accuracy": 0.7}}
    assert evaluate_rows({"method": "classify", "splits": splits, "generation": {}}) == [
        {"split": "test", "accuracy": 0.8}, {"split": "validation", "accuracy": 0.7}]
    assert evaluate_rows({"accuracy": 0.8, "by": {"test": {"n": 5}}}) == [
        {"metric": "accuracy", "value": 0.8}, {"metric": "by.test.n", "value": 5}]
    assert evaluate_rows(None) == []

    files = [{"path": "adapter/adapter_model.safetensors", "size": 100}, {"path": "adapter/adapter_config.json",
             "size": 5}, {"path": "README.md", "size": 7}]
    export = Outcome("export", "c" * 64, tmp_path / "export", True, "computed",
                     {"files": files, "metrics": {"files": ["adapter"], "command": "python -m flows.finetune x"}})
    assert export_rows(export) == [
        {"path": str(tmp_path / "export" / "README.md"), "files": 1, "size_bytes": 7},
        {"path": str(tmp_path / "export" / "adapter"), "files": 2, "size_bytes": 105}]


def test_serve_stops_within_seconds_of_ctrl_c_after_a_failed_run(server):
    """A run that fails on a user error shows one line in serve's console (no traceback), and Ctrl-C then
    stops serving within 15 s (the goal is 10: the clock starts at the signal)."""
    serve = start_serve(server, "serve-failed")
    try:
        missing = {"data.source": "local", "data.path": "/nonexistent/reviews.csv"}
        res = subprocess.run([str(BIN / "prefect"), "deployment", "run", f"finetune/{PIPELINE}", "-p",
                              f"overrides={json.dumps(missing)}", "--watch", "--watch-timeout", "300"], cwd=ROOT,
                             env=server["env"], capture_output=True, text=True, timeout=330, start_new_session=True)
        out = res.stdout + res.stderr
        assert "Flow run finished in state 'Failed'" in out, out[-3000:]
        run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
        flow_run = httpx.get(f"{server['api']}/flow_runs/{run_id}", timeout=30).json()
        assert flow_run["state"]["type"] == "FAILED"
        assert flow_run["state"]["message"].startswith("MissingInputError: data.path /nonexistent/reviews.csv: no such")
        wait_until("the failure in serve's console", lambda: "MissingInputError" in serve.output(), 30, serve)
        time.sleep(2)  # the flow-run process has exited; serve is idle again
        console = serve.output()
        assert "Traceback" not in console, console[-3000:]
        assert len([ln for ln in console.splitlines() if "MissingInputError" in ln]) == 1, console[-3000:]

        t0 = time.monotonic()
        os.kill(serve.p.pid, signal.SIGINT)
        try:
            rc = serve.p.wait(15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"flows.serve still running 15 s after Ctrl-C:\n{serve.output()[-3000:]}")
        print(f"flows.serve exited {time.monotonic() - t0:.1f} s after Ctrl-C")
        assert rc == 0, serve.output()[-3000:]
        assert "flows.serve: stopped" in serve.output()
    finally:
        serve.stop()


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(x) for x in (task / "children").read_text().split()]
    return out


@needs_shared_data
def test_ctrl_c_during_a_run_cancels_it_and_stops_serving(server):
    """Ctrl-C while a run trains: serve exits within 15 s, the run's process is gone and its state is
    Cancelled with the train stage's checkpoint written (Crashed only if the graceful stop overran its
    deadline and serve killed it, which it says), never left Running."""
    serve = start_serve(server, "serve-busy")
    try:
        long = {**SMALL, "train.max_steps": 100000}
        res = subprocess.run([str(BIN / "prefect"), "deployment", "run", f"finetune/{PIPELINE}", "-p",
                              f"overrides={json.dumps(long)}"], cwd=ROOT, env=server["env"], capture_output=True,
                             text=True, timeout=120, start_new_session=True)
        run_id = re.search(r"UUID: ([0-9a-f-]{36})", res.stdout + res.stderr).group(1)

        def training() -> bool:
            runs = api_post(server, "task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
            return any(r["name"].startswith("train-") and (r.get("state") or {}).get("type") == "RUNNING"
                       for r in runs)

        wait_until("the train stage to run", training, 300, serve)
        wait_until("a training step", lambda: re.search(r"finetune\.train - Epoch: \d+ \|.* Step \d+", serve.output()),
                   300, serve)  # into the training loop (its imports take seconds on a loaded machine)
        workers = children(serve.p.pid)
        assert workers, "the flow run's process"

        t0 = time.monotonic()
        os.kill(serve.p.pid, signal.SIGINT)
        try:
            rc = serve.p.wait(15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"flows.serve still running 15 s after Ctrl-C:\n{serve.output()[-3000:]}")
        print(f"flows.serve exited {time.monotonic() - t0:.1f} s after Ctrl-C during a run")
        assert rc == 0, serve.output()[-3000:]
        state = httpx.get(f"{server['api']}/flow_runs/{run_id}", timeout=30).json()["state"]
        out = serve.output()
        if "marked Crashed" in out:  # the graceful stop overran its deadline (a loaded machine): killed, Crashed
            assert state["type"] == "CRASHED", state
        else:  # cancelled, the train stage checkpointed where it stopped, and the log says both
            assert state["type"] == "CANCELLED", (state, out[-3000:])
            stop = re.search(r"train: SIGTERM at step (\d+) of 100000: checkpoint (\S+);", out)
            assert stop and Path(stop.group(2), "progress.json").is_file(), out[-3000:]
            assert "flows.serve: stopping (runs in progress are cancelled" in out and "Cancelled flow run" in out
            assert "Finished in state Running()" not in out  # the engine's line, rewritten (CANCELLED_BY_RUNNER)
        time.sleep(1)
        for pid in workers:
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    finally:
        serve.stop()
