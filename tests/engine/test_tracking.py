"""Experiment tracking against a real MLflow server (tests/mlflowserver.py: sqlite, 127.0.0.1), read back through
MlflowClient: a run's params are its resolved config, its loss history has one point per optimizer step, its
validation and test metrics and its stages' keys are there, and a cached rerun is a second run, tagged cached,
with the same metrics; metrics go out in batches; a server that dies mid-run or never answers costs one warning
and the run finishes; tracking that cannot work is one line at plan time; no key depends on tracking. The sweep's
parent and nested runs: tests/flows/test_sweep.py."""

from __future__ import annotations

import json
import logging
import signal
import socket
import sys
import time
import uuid

import pytest
from cluster import stop
from helpers import IMDB, computed, needs_shared_data, spawn
from mlflowserver import mlflow_server

from stages.__main__ import main as stages_main
from stages.engine.runner import execute
from stages.engine.store import Store
from stages.graph import GRAPH
from stages.pipeline.loading import load_pipeline
from stages.pipeline.tracking import TRACK_ENV, Settings, Tracker

SETS = (*IMDB, "train.max_steps=6", "train.eval_every=2")


def experiment_runs(url: str, experiment: str) -> list:
    from mlflow import MlflowClient

    c = MlflowClient(url)
    exp = c.get_experiment_by_name(experiment)
    return [] if exp is None else c.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def leaves(data: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out.update(leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@needs_shared_data
def test_a_tracked_run_holds_its_config_history_metrics_and_keys_and_a_cached_rerun_the_same(mlflow_url, tmp_path,
                                                                                            monkeypatch):
    from mlflow import MlflowClient

    batches = []  # every log_batch request that carried metrics: how many metrics it carried
    real = MlflowClient.log_batch

    def counted(self, run_id, metrics=(), *a, **kw):
        if metrics:
            batches.append(len(metrics))
        return real(self, run_id, metrics, *a, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", counted)
    experiment = f"test-{uuid.uuid4().hex[:8]}"
    cfg = load_pipeline("tiny-imdb", [*SETS, f"tracking.mlflow.uri={mlflow_url}",
                                      f"tracking.mlflow.experiment={experiment}"])
    store = Store(tmp_path / "store")
    plan = GRAPH.plan(cfg, store)
    first = {o.stage: o for o in execute(plan, store)}
    live_batches = list(batches)
    second = {o.stage: o for o in execute(GRAPH.plan(cfg, store), store)}
    assert computed(first) == set(GRAPH.names) and not computed(second)

    c = MlflowClient(mlflow_url)
    runs = experiment_runs(mlflow_url, experiment)
    assert len(runs) == 2
    run, rerun = runs
    records = [json.loads(line) for line in (first["train"].path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "validation"]
    assert len(train) == 6 and [r["step"] for r in val] == [2, 4, 6]
    # metrics were buffered: the whole run's (6 steps x 8 numbers, validations, the stages' metrics) in a few
    # requests, not one per step
    assert sum(live_batches) >= 6 * 8 and len(live_batches) < len(train), live_batches

    for r, status in ((run, "computed"), (rerun, "cached")):
        assert r.info.status == "FINISHED"
        tags, metrics, rid = r.data.tags, r.data.metrics, r.info.run_id
        # params: the resolved config, one per field (dotted), each value read back equal
        want = leaves(plan.cfg.model_dump(mode="json", exclude={"overrides", "config_file", "extends"}))
        got = r.data.params
        assert set(got) == set(want)
        for k, v in want.items():
            assert (got[k] if isinstance(v, str) else json.loads(got[k])) == v, k
        assert json.loads(tags["finetune.set"]) == list(cfg.overrides)
        # the history: one point per optimizer step, MLflow's step = the optimizer step; validation at its steps
        for name, field, recs in (("train/loss", "loss", train), ("train/lr", "lr", train),
                                  ("train/grad_norm", "grad_norm", train),
                                  ("train/tokens_per_s", "tokens_per_s", train),
                                  ("validation/val_accuracy", "val_accuracy", val)):
            points = sorted((m.step, m.value) for m in c.get_metric_history(rid, name))
            assert [s for s, _ in points] == [x["step"] for x in recs], name
            assert [v for _, v in points] == pytest.approx([x[field] for x in recs]), name
        ev = first["evaluate"].manifest["metrics"]["splits"]["test"]
        assert metrics["evaluate.splits.test.accuracy"] == pytest.approx(ev["accuracy"])
        assert metrics["evaluate.splits.test.macro_f1"] == pytest.approx(ev["macro_f1"])
        assert metrics["train.final_loss"] == pytest.approx(first["train"].manifest["metrics"]["final_loss"])
        # each stage's key and whether it was computed; the model it produced; the precision chosen
        for stage, o in first.items():
            assert (tags[f"finetune.{stage}.key"], tags[f"finetune.{stage}.status"]) == (o.key, status)
        assert tags["finetune.model_path"] == str(first["export"].path)
        assert tags["finetune.cached"] == ("true" if status == "cached" else "false")
        assert tags["finetune.precision"] == plan.cfg.train.mixed_precision == tags["finetune.train.precision"]
        assert tags["finetune.pipeline"] == "tiny-imdb" and tags["finetune.store"] == str(store.root)
        arts = {a.path for folder in ("train", "evaluate", "export") for a in c.list_artifacts(rid, folder)}
        assert arts == {"train/loss.png", "evaluate/metrics.json", "export/README.md",
                        "export/finetune_pipeline.yaml"}
        card = c.download_artifacts(rid, "export/README.md", str(tmp_path / status))
        assert open(card, "rb").read() == (first["export"].path / "README.md").read_bytes()
    assert run.data.metrics == rerun.data.metrics  # the cached run's, read from the artifacts: the same numbers


def test_tracking_is_in_no_key(tmp_path):
    plain = load_pipeline("tiny-imdb", list(SETS))
    tracked = load_pipeline("tiny-imdb", [*SETS, "tracking.mlflow.uri=http://127.0.0.1:9",
                                          "tracking.mlflow.experiment=other"])
    assert [i.key.key for i in GRAPH.plan(plain).items] == [i.key.key for i in GRAPH.plan(tracked).items]


@needs_shared_data
def test_tracking_that_cannot_work_is_one_line_at_plan_time(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(TRACK_ENV, "")  # --track sets it; restored (removed) after the test
    monkeypatch.setenv("FINETUNE_STORE", str(tmp_path / "store"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert stages_main(["tiny-imdb", "--track"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names no MLflow server" in err[0] and "MLFLOW_TRACKING_URI" in err[0], err

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    assert stages_main(["tiny-imdb", "--track"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MLflow is not installed: pip install '.[mlflow]'" in err[0], err
    assert not (tmp_path / "store").exists()  # refused before anything was written


@needs_shared_data
def test_a_server_killed_mid_run_costs_one_warning_and_the_run_finishes(tmp_path):
    from mlflow import MlflowClient

    experiment = f"test-{uuid.uuid4().hex[:8]}"
    with mlflow_server(tmp_path / "mlflow") as (url, server):
        proc = spawn(["tiny-imdb", "--track", *(a for s in SETS for a in ("--set", s))], tmp_path / "store",
                     MLFLOW_TRACKING_URI=url, MLFLOW_EXPERIMENT_NAME=experiment)
        c = MlflowClient(url)
        deadline = time.monotonic() + 120
        while True:  # the run exists and its first stage is in: then the server goes away
            runs = experiment_runs(url, experiment)
            if runs and "finetune.data.status" in c.get_run(runs[0].info.run_id).data.tags:
                break
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.2)
        stop(server, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    warnings = [line for line in out.splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and f"tracking: MLflow at {url} failed" in warnings[0], out
    assert all(f"  {stage:<10} computed" in out for stage in GRAPH.names), out


def test_a_refused_connection_is_one_warning_that_keeps_the_cause_and_cuts_no_word(monkeypatch, caplog):
    """MLflow's error for a server that is not there runs past 300 characters and ends in its cause: the warning
    keeps its start and its end, each cut at a space, never inside a word."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    caplog.set_level(logging.WARNING, logger="finetune.tracking")
    raised: list[BaseException] = []
    give_up = Tracker._give_up
    monkeypatch.setattr(Tracker, "_give_up", lambda self, e: (raised.append(e), give_up(self, e)))
    tracker = Tracker(Settings(f"http://127.0.0.1:{port}", "x"), "run", {})
    tracker.end(wait_s=30)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    full = " ".join(str(raised[0]).split())
    shown = warnings[0].split(f"{type(raised[0]).__name__}: ", 1)[1].rsplit("); this run goes on untracked", 1)[0]
    assert len(warnings) == 1 and len(full) > 250 and "Connection refused" in shown, warnings
    head, tail = shown.split(" … ")
    assert full.startswith(head + " ") and full.endswith(" " + tail) and len(shown) <= 200, (shown, full)


def test_a_server_that_never_answers_holds_the_end_of_a_run_at_most_its_wait(monkeypatch, caplog):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # the kernel accepts connections; nobody ever answers
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    caplog.set_level(logging.WARNING, logger="finetune.tracking")
    t0 = time.monotonic()
    tracker = Tracker(Settings(f"http://127.0.0.1:{listener.getsockname()[1]}", "x"), "run", {})
    tracker.metrics([("train/loss", 1.0, 1)])
    tracker.end(wait_s=2)
    took = time.monotonic() - t0
    listener.close()
    assert took < 6, took
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "did not take this run's last records within 2 s" in warnings[0], warnings
