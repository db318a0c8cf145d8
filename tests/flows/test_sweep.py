"""Sweeps: a tiny sweep over two learning rates through the `sweep` flow (the worker's Prefect server,
tests/conftest.py; each child run in its own process) computes the stages the variants share once, two at a time (Prefect's
thread-pool task runner; tests/flows/test_user_session.py runs one sequentially), and SIGTERM ends the children; `compare` ranks the variants from the store; `diff` names what differs and why. Bad sweep definitions
are one line and exit 2, before Prefect starts."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest
from helpers import ROOT, needs_shared_data, run_pipeline, subprocess_env

import flows.orchestration  # noqa: F401  (project Prefect defaults)
from flows.console import main as console_main
from flows.inspect import main as inspect_main
from flows.reports import comparison as compare
from flows.reports.config_diff import diff, render_diff
from flows.reports.variants import adhoc_sweep, named_sweep, parse_grid
from flows.sweep import main as sweep_main
from stages.engine.errors import ConfigError
from stages.engine.store import Store
from stages.pipeline.loading import load_pipeline, load_sweep
from stages.pipeline.tracking import TRACK_ENV

EXTRA = """
  lr-pair:
    description: tests - two learning rates of tiny-imdb
    pipeline: tiny-imdb
    set:
      data.subset: {train: 16, validation: 4, test: 8}
      train.max_steps: 2
    grid:
      train.lr: [1.0e-3, 1.0e-2]
    metric: test.accuracy
"""
SHARED = ("data", "tokenize", "model", "adapters")
PER_VARIANT = ("train", "evaluate", "export")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("sweep") / "pipeline.yaml"
    path.write_text((ROOT / "pipeline.yaml").read_text().replace("\nsweeps:\n", "\nsweeps:" + EXTRA, 1))
    return path


def ui_artifacts(key: str):
    """The latest artifact the Prefect API holds under `key`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    found = asyncio.run(read())
    assert found, f"no artifact {key}"
    return max(found, key=lambda a: a.created)


def computed_per_stage(store) -> Counter:
    return Counter(e["stage"] for e in Store(store).events() if e.get("event") == "computed")


# ---------------------------------------------------------------- definitions (no run)


def test_named_and_adhoc_sweeps_expand_to_validated_runs(config):
    sw = named_sweep("lr-pair", config)
    assert [r.label for r in sw.runs] == ["lr=0.001", "lr=0.01"]
    assert [r.cfg.train.lr for r in sw.runs] == [1e-3, 1e-2]
    assert all(r.cfg.train.max_steps == 2 and r.cfg.data.subset == {"train": 16, "validation": 4, "test": 8}
               for r in sw.runs)
    seeded = adhoc_sweep("tiny-imdb", ["train.lr=1e-3,5e-4"], ["train.max_steps=2"], seeds=[1, 2], config_file=config)
    assert [(r.variant, r.seed, r.cfg.train.seed) for r in seeded.runs] == [
        ("lr=0.001", 1, 1), ("lr=0.0005", 1, 1), ("lr=0.001", 2, 2), ("lr=0.0005", 2, 2)]
    assert parse_grid(["evaluate.splits=[test],[validation, test]"]) == {
        "evaluate.splits": [["test"], ["validation", "test"]]}


@pytest.mark.parametrize(("body", "expected"), [
    ("grid: {train.lr: [1.0e-3]}\n    variants: [{train.lr: 1.0e-2}]", "give either grid"),
    ("grid: {train.lr: [1.0e-3]}\n    sedes: [1]", "sweeps.bad.sedes: unknown key; valid keys here:"),
    ("grid: {lr: [1.0e-3]}", "must be dotted SECTION.FIELD"),
    ("grid: {train.lr: [1.0e-3]}\n    metric: accuracy", "write SPLIT.METRIC"),
    ("grid: {train.lr: [1.0e-3]}\n    seeds: [1]\n    set: {train.seed: 3}", "train.seed is set by seeds"),
])
def test_bad_sweep_definitions_are_one_line(tmp_path, body, expected):
    path = tmp_path / "pipeline.yaml"
    bad = f"\n  bad:\n    pipeline: tiny-imdb\n    {body}\n"
    path.write_text((ROOT / "pipeline.yaml").read_text().replace("\nsweeps:\n", "\nsweeps:" + bad, 1))
    with pytest.raises(ConfigError) as err:
        load_sweep("bad", path)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_bad_variant_value_names_the_variant_and_exits_2(config, capsys):
    # the value reaches the pipeline schema only when the run's config is loaded: before Prefect starts
    assert sweep_main(["tiny-imdb", "--grid", "train.lr=1e-3,2", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: sweeps.tiny-imdb-") and "variant lr=2: --set train.lr: must be < 1" in err
    assert sweep_main(["no-such-sweep", "--config", str(config)]) == 2
    assert "unknown sweep 'no-such-sweep'; available: lr-pair, accumulation" in capsys.readouterr().err
    assert sweep_main(["tiny-imdb", "--config", str(config)]) == 2
    assert "tiny-imdb is a pipeline, not a sweep: give --grid" in capsys.readouterr().err


# ---------------------------------------------------------------- the flow, compare and diff


@needs_shared_data
def test_parallel_children_share_stages_through_the_store_lock_then_compare_and_diff(prefect_server, config,
                                                                                    store_dir, mlflow_url, monkeypatch):
    """Two children at once (one sweep run for all that follows: a sequential sweep is run by
    tests/flows/test_user_session.py): the stages they share computed once, through the store's lock. Tracked
    (--track's variable): one MLflow parent run for the sweep, a run nested under it per child."""
    # no capsys in the tests that run flows: Prefect's log handler would keep its closed stream
    from flows.orchestration.sweep_flow import run_sweep

    experiment = f"sweep-{os.getpid()}-{time.time_ns()}"
    for k, v in ((TRACK_ENV, "1"), ("MLFLOW_TRACKING_URI", mlflow_url), ("MLFLOW_EXPERIMENT_NAME", experiment)):
        monkeypatch.setenv(k, v)
    state = run_sweep("lr-pair", parallel=2, config=str(config), return_state=True)
    assert state.is_completed(), state.message
    assert [r["run"] for r in state.result()] == ["lr=0.001", "lr=0.01"]
    counts = computed_per_stage(store_dir)
    assert {s: counts[s] for s in SHARED + PER_VARIANT} == {**dict.fromkeys(SHARED, 1), **dict.fromkeys(PER_VARIANT, 2)}
    # the two children (processes) overlapped: the second's first outcome came before the first's last
    times: dict[int, list[str]] = {}
    for e in Store(store_dir).events():
        times.setdefault(e["pid"], []).append(e["time"])
    assert len(times) == 2
    first, second = sorted(times.values())
    assert second[0] < first[-1]
    folder = store_dir / "sweeps" / "lr-pair"
    assert (folder / "chart.png").stat().st_size > 1000
    table, chart = ui_artifacts("sweep-lr-pair"), ui_artifacts("sweep-lr-pair-chart")
    assert table.type == "table" and {r["lr"] for r in json.loads(table.data)} == {"0.001", "0.01"}
    assert chart.type == "markdown" and str(folder / "chart.png") in chart.data

    # what `compare --sweep lr-pair --json` prints (and the sweep wrote beside its chart)
    report = json.loads(json.dumps(compare.compare(named_sweep("lr-pair", config), Store(store_dir)).to_json(), default=str))
    assert json.loads((folder / "comparison.json").read_text()) == report
    assert report["metric"] == "test.accuracy" and len(report["variants"]) == 2
    by = {v["params"]["train.lr"]: v for v in report["variants"]}
    assert set(by) == {1e-3, 1e-2}
    for v in by.values():
        (run,) = v["runs"]
        assert v["status"] == "done" and v["n"] == 1 and 0 <= v["mean"] <= 1
        assert v["mean"] == run["metrics"]["test.accuracy"]
        assert run["shared"] == list(SHARED) and run["train_s"] > 0 and run["trainable"] > 0
    means = [v["mean"] for v in report["variants"]]
    assert means == sorted(means, reverse=True) and [v["rank"] for v in report["variants"]] == [1, 2]
    rows = list(csv.DictReader(io.StringIO((folder / "runs.csv").read_text())))
    assert sorted(float(r["train.lr"]) for r in rows) == [1e-3, 1e-2] and all(r["status"] == "done" for r in rows)

    # diff: lr changes train (why: the param) and what consumes it (why: its upstream); the rest is shared
    common = ["data.subset={train: 16, validation: 4, test: 8}", "train.max_steps=2"]
    d = diff(load_pipeline("tiny-imdb", [*common, "train.lr=1e-3"], config),
             load_pipeline("tiny-imdb", [*common, "train.lr=1e-2"], config), Store(store_dir))
    stages = {s["stage"]: s for s in d["stages"]}
    assert {s for s, v in stages.items() if v["shared"]} == set(SHARED)
    assert stages["train"]["why"] == ["changed params: train.lr"]
    assert stages["evaluate"]["why"] == ["changed upstream: train"]
    assert d["params"] == [{"param": "train.lr", "a": 1e-3, "b": 1e-2, "a_set": True, "b_set": True}]
    acc = next(m for m in d["metrics"] if m["metric"] == "evaluate.test.accuracy")
    assert (acc["a"], acc["b"]) == (by[1e-3]["mean"], by[1e-2]["mean"]) and not acc["a_stale"]
    assert "train.lr" in render_diff(d) and "changed params: train.lr" in render_diff(d)

    # MLflow: the sweep's parent run (its comparison as artifacts), each child's run nested under it
    from mlflow import MlflowClient

    c = MlflowClient(mlflow_url)
    runs = c.search_runs([c.get_experiment_by_name(experiment).experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("finetune.kind") == "sweep"]
    children = [r for r in runs if r is not parent]
    assert parent.info.run_name == "lr-pair" and parent.info.status == "FINISHED"
    assert {r.info.run_name for r in children} == {"lr=0.001", "lr=0.01"}
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert {r.data.params["train.lr"] for r in children} == {"0.001", "0.01"}
    assert all(r.data.tags["finetune.sweep"] == "lr-pair" and r.info.status == "FINISHED" for r in children)
    assert all(len(r.data.tags["finetune.prefect.flow_run_id"]) == 36 for r in children)  # the child flow run's id
    assert {a.path for a in c.list_artifacts(parent.info.run_id)} == {"comparison.md", "comparison.json",
                                                                      "runs.csv", "chart.png"}
    for r in children:
        lr = float(r.data.params["train.lr"])
        assert r.data.metrics["evaluate.splits.test.accuracy"] == by[lr]["mean"]

    # each child is a result of the sweep (its process got FINETUNE_SWEEP): gc --force keeps both variants
    assert sorted(r["sweep"] for _, r in Store(store_dir).results()) == ["lr-pair", "lr-pair"]
    assert inspect_main(["gc", "--force", "--min-age", "0", "--config", str(config)]) == 0
    kept = compare.compare(named_sweep("lr-pair", config), Store(store_dir))
    assert [v.status() for v in kept.variants] == [compare.DONE, compare.DONE]


@needs_shared_data
def test_compare_lists_runs_not_yet_run_and_stale_results(config, store_dir, capsys):
    """One of two variants run (plain runner, no Prefect): it is `done`, the other `not run`; once its
    evaluate artifact exists only under another key (as after a code change), its results show as `stale`."""
    sw = adhoc_sweep("tiny-imdb", ["train.lr=1e-3,1e-2"], ["data.subset={train: 16, validation: 4, test: 8}",
                                                     "train.max_steps=2"], config_file=config)
    outcomes = {o.stage: o for o in run_pipeline(sw.runs[0].cfg, Store(store_dir), until="evaluate")}
    args = ["compare", "tiny-imdb", "--grid", "train.lr=1e-3,1e-2", "--set",
            "data.subset={train: 16, validation: 4, test: 8}", "--set", "train.max_steps=2", "--config", str(config)]
    assert inspect_main(args) == 1
    out = capsys.readouterr().out
    acc = outcomes["evaluate"].manifest["metrics"]["splits"]["test"]["accuracy"]
    assert f"| 1 | 0.001 | 1 | {100 * acc:.1f}% |" in out and "| done |" in out
    assert "| - | 0.01 | 0 | - |" in out and "| not run |" in out
    assert inspect_main([*args, "--json"]) == 1
    rows = {v["params"]["train.lr"]: v for v in json.loads(capsys.readouterr().out)["variants"]}
    assert rows[1e-3]["mean"] == acc and rows[1e-3]["status"] == "done" and rows[1e-2]["status"] == "not run"
    assert inspect_main([*args, "--csv"]) == 1
    assert [r["status"] for r in csv.DictReader(io.StringIO(capsys.readouterr().out))] == ["done", "not run"]
    assert inspect_main(["diff", "tiny-imdb", "--set-a", "train.lr=1e-3", "--set", "train.lr=1e-2",
                         "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "  train     differs" in out and "changed params: train.lr" in out and "  model     shared" in out

    # the same parameters, another key (code changed since): shown with its results, marked stale
    ev = outcomes["evaluate"]
    old_key = "0" * 64
    manifest = json.loads((ev.path / "manifest.json").read_text())
    (ev.path / "manifest.json").write_text(json.dumps({**manifest, "key": old_key}))
    ev.path.rename(ev.path.parent / old_key)
    c = compare.compare(sw, Store(store_dir))
    first = next(v for v in c.variants if v.params["train.lr"] == 1e-3)
    assert first.status() == "stale" and first.runs[0].keys["evaluate"] == old_key and first.mean() == acc

    # seeds: mean ± sd over the seeds, and how many of them have results
    assert inspect_main([*args, "--seeds", "1,2"]) == 1
    out = capsys.readouterr().out
    assert "mean ± sd over seeds 1, 2" in out and out.count("| not run |") == 2 and "| 0/2 |" in out


def test_serve_builds_a_sweep_deployment_per_named_sweep():
    from flows.orchestration.serving import deployments

    deps = {(d.flow_name, d.name): d for d in deployments(["accumulation", "tiny-imdb"])}
    assert set(deps) == {("sweep", "accumulation"), ("finetune", "tiny-imdb")}
    assert deps["sweep", "accumulation"].parameters == {"name": "accumulation"}
    assert deps["sweep", "accumulation"].entrypoint == "flows.orchestration.sweep_flow.run_sweep"


def test_a_mapping_valued_variant_names_its_task_run_as_given():
    """Prefect formats a task-run name with the task's parameters: a label with a mapping's braces failed
    every child with KeyError 'train' before they were doubled."""
    from flows.orchestration.compat_prefect import literal_task_run_name

    label = "subset={train:4096,validation:64,test:1000}"
    with pytest.raises(KeyError):
        label.format(sweep_name="imdb-90")
    assert literal_task_run_name(label).format(sweep_name="imdb-90") == label


@needs_shared_data
def test_sigterm_ends_the_parallel_children_and_the_temporary_server(tmp_path):
    """`python -m flows.sweep ... --parallel 2` (Prefect's thread-pool task runner, one process per child)
    stopped by `kill PID` while both children train: it exits 143 within seconds, no child process is left
    in its process group, and its temporary Prefect server is stopped."""
    env = subprocess_env(tmp_path / "store")
    env.pop("PREFECT_API_URL", None)  # a temporary server, as for a user without one
    log = tmp_path / "out.log"
    with log.open("w") as fh:
        p = subprocess.Popen([sys.executable, "-m", "flows.sweep", "tiny-imdb", "--grid", "train.lr=1e-3,1e-2",
                              "--set", "train.epochs=1000", "--set", "data.subset={train: 32, validation: 8, test: 8}",
                              "--parallel", "2"], cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            deadline = time.monotonic() + 400
            while len(re.findall(r"finetune\.train - train: \d+ examples", log.read_text())) < 2:  # both train
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
            port = int(re.search(r"temporary server on http://127\.0\.0\.1:(\d+)", log.read_text()).group(1))
            stopped_at = time.monotonic()
            p.send_signal(signal.SIGTERM)
            code = p.wait(timeout=90)
            print(f"sigterm: exit {code} after {time.monotonic() - stopped_at:.1f} s")  # shown with pytest -s -n 0
            left = time.monotonic() + 20
            while True:  # the children exit with the sweep (and are reaped by init)
                try:
                    os.killpg(p.pid, 0)
                except ProcessLookupError:
                    break
                assert time.monotonic() < left, "a child process outlived the sweep"
                time.sleep(0.5)
        finally:
            with contextlib.suppress(ProcessLookupError):  # whatever is left in its group
                os.killpg(p.pid, signal.SIGKILL)
    out = log.read_text()
    assert code == 143, out[-3000:]
    assert "terminated; committed stages stay in the store" in out
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


# ---------------------------------------------------------------- commands that work as printed


def test_an_adhoc_sweep_is_compared_by_name_with_the_command_it_prints(config, store_dir, capsys):
    import shlex

    from flows.reports.variants import compare_hint, save_definition

    sets = ["data.subset={train: 16, validation: 4, test: 8}", "train.max_steps=2"]
    sw = adhoc_sweep("tiny-imdb", ["train.lr=1e-3,1e-2"], sets, name="my-lrs", config_file=config)
    hint = compare_hint(sw)
    assert hint == f"finetune inspect compare --sweep my-lrs --config {config.resolve()}"
    save_definition(sw, Store(store_dir))  # what `python -m flows.sweep ... --name my-lrs` keeps before it runs
    argv = shlex.split(hint)
    assert argv[0] == "finetune" and console_main(argv[1:]) == 1  # the console command as printed; 1: nothing run yet
    out = capsys.readouterr().out
    assert "| 0.001 |" in out and "| 0.01 |" in out and out.count("| not run |") == 2
    by_grid = compare.compare(adhoc_sweep("tiny-imdb", ["train.lr=1e-3,1e-2"], sets, config_file=config),
                              Store(store_dir)).to_json()
    assert inspect_main([*argv[2:], "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["variants"] == json.loads(json.dumps(by_grid["variants"],
                                                                                    default=str))


def test_a_sweep_found_by_name_keeps_its_grids_order(config, store_dir, capsys):
    """`--grid train.max_steps=... --grid train.lr=...`: max_steps sorts after lr and stays the first (slowest)
    key in sweep.json, so `compare --sweep NAME` prints the table, CSV and variant labels of the sweep's own
    comparison.md, runs.csv and comparison.json. A sweep.json written sorted (before) still reads."""
    from flows.reports.sweep_outputs import write_outputs
    from flows.reports.variants import save_definition

    sw = adhoc_sweep("tiny-imdb", ["train.max_steps=1,2", "train.lr=1e-3,1e-2"],
                     ["data.subset={train: 16, validation: 4, test: 8}"], name="steps-lrs", config_file=config)
    store = Store(store_dir)
    saved = save_definition(sw, store)  # what `finetune sweep tiny-imdb --grid ... --name steps-lrs` keeps
    own = write_outputs(compare.compare(sw, store), store)  # what the sweep flow writes when its runs end
    assert list(json.loads(saved.read_text())["spec"]["grid"]) == ["train.max_steps", "train.lr"]
    argv = ["compare", "--sweep", "steps-lrs", "--config", str(config)]
    assert inspect_main(argv) == 1  # 1: nothing run yet
    table = capsys.readouterr().out
    assert table == own["table"].read_text()
    assert table.splitlines()[2].startswith("| rank | max_steps | lr |")
    assert inspect_main([*argv, "--csv"]) == 1
    assert capsys.readouterr().out.splitlines() == own["csv"].read_text().splitlines()
    assert own["csv"].read_text().startswith("variant,train.max_steps,train.lr,")
    assert inspect_main([*argv, "--json"]) == 1
    labels = [v["variant"] for v in json.loads(capsys.readouterr().out)["variants"]]
    assert labels == [v["variant"] for v in json.loads(own["json"].read_text())["variants"]]
    assert labels == ["max_steps=1 lr=0.001", "max_steps=1 lr=0.01", "max_steps=2 lr=0.001", "max_steps=2 lr=0.01"]
    saved.write_text(json.dumps(json.loads(saved.read_text()), sort_keys=True))  # as an older version wrote it
    assert inspect_main(argv) == 1
    assert capsys.readouterr().out.splitlines()[2].startswith("| rank | lr | max_steps |")


def test_shared_names_the_stages_other_variants_have_not_a_variants_own_seeds(tmp_path):
    """Variants that differ in adapters.r share data/tokenize/model; each variant's two seeds share its own
    adapters artifact, which is not shared with the other variant."""
    sw = adhoc_sweep("tiny-billsum", ["adapters.r=4,8"], ["train.max_steps=2"], seeds=[1, 2])
    c = compare.compare(sw, Store(tmp_path / "empty-store"))
    for v in c.variants:
        assert all(r.shared == ["data", "tokenize", "model"] for r in v.runs), [r.shared for r in v.runs]
    assert {row["shared"] for row in compare.table_rows(c)} == {"data,tokenize,model"}


def test_a_variant_that_cannot_run_is_refused_before_prefect(config, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert sweep_main(["tiny-imdb", "--grid", "evaluate.metrics=[accuracy],[acuracy]", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "variant metrics=[acuracy]: evaluate.metrics acuracy: not one of the project's " \
        "offline modules" in err[0] and "did you mean accuracy?" in err[0]


def test_serve_with_a_users_file_carries_it_in_every_deployment(tmp_path):
    from flows.orchestration.serving import deployments
    from stages.engine.config import own_names

    path = tmp_path / "mine.yaml"
    path.write_text("pipelines:\n  mine:\n    extends: tiny-imdb\nsweeps:\n  mine-lrs:\n    pipeline: mine\n"
                    "    grid: {train.lr: [1.0e-3, 1.0e-2]}\n")
    assert own_names(path) == ["mine", "mine-lrs"]  # what `python -m flows.serve --config FILE` serves
    deps = {(d.flow_name, d.name): d for d in deployments(own_names(path), path)}
    assert deps["finetune", "mine"].parameters == {"pipeline": "mine", "config": str(path.resolve())}
    assert deps["sweep", "mine-lrs"].parameters == {"name": "mine-lrs", "config": str(path.resolve())}
