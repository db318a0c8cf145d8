"""The store inspector (`python -m flows.inspect`): status in dvc words, show/path, gc dry run and --force.
One small tiny-imdb pipeline run (all stages) is shared by the module; nothing here runs Prefect."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, needs_shared_data, plan, run_pipeline, subprocess_env

from flows.inspect import main
from stages.engine import runner
from stages.engine.status import pipeline_status
from stages.engine.store import Store
from stages.graph import GRAPH
from stages.pipeline.loading import load_pipeline

pytestmark = needs_shared_data

PIPELINE = "small"
EXTRA = """
  small:
    extends: tiny-imdb
    description: tests - tiny-imdb on 40 reviews
    data:
      subset: {train: 40, validation: 8, test: 8}
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A pipeline file = the project's plus `small`, a store holding one full run of it."""
    root = tmp_path_factory.mktemp("inspect")
    config = root / "pipeline.yaml"
    config.write_text((ROOT / "pipeline.yaml").read_text().replace("\npipelines:\n", "\npipelines:" + EXTRA, 1))
    store = root / "store"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FINETUNE_STORE", str(store))
        run_pipeline(load_pipeline(PIPELINE, None, config), Store(store))
        yield config, store


def inspect(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(list(argv))
    return rc, capsys.readouterr().out


def test_status_names_the_changed_field_and_marks_dependents(env, capsys):
    config, store = env
    stages = [i.stage.name for i in plan(load_pipeline(PIPELINE, None, config))]

    rc, out = inspect(capsys, "status", PIPELINE, "--config", str(config), "--json")
    assert rc == 0
    report = json.loads(out)
    assert {s["stage"]: s["status"] for s in report["stages"]} == dict.fromkeys(stages, "cached")
    train = next(s for s in report["stages"] if s["stage"] == "train")
    folder = Path(train["path"])
    on_disk = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert train["size_bytes"] == on_disk and train["created"] and "final_loss" in train["metrics"]

    # one tokenize field: tokenize and what consumes it (train) are stale; the rest stay cached
    rc, out = inspect(capsys, "status", PIPELINE, "--config", str(config), "--set", "tokenize.max_length=64",
                      "--json")
    assert rc == 1
    by = {s["stage"]: s for s in json.loads(out)["stages"]}
    stale = {n for n, s in by.items() if s["status"] == "stale"}
    downstream = {"tokenize", "train"} | ({"evaluate", "export"} & set(stages))
    assert stale == downstream
    assert all(s["status"] == "cached" for n, s in by.items() if n not in downstream)
    assert by["tokenize"]["reasons"] == ["changed params: tokenize.max_length"]
    assert by["train"]["reasons"] == ["changed upstream: tokenize"]
    assert by["tokenize"]["artifact_key"] == Store(store).refs(PIPELINE)["tokenize"]  # compared with last run

    # the readable table says the same
    rc, out = inspect(capsys, "status", PIPELINE, "--config", str(config), "--set", "tokenize.max_length=64")
    lines = out.splitlines()
    tok = next(i for i, ln in enumerate(lines) if ln.startswith("tokenize "))
    assert " stale " in lines[tok] and lines[tok + 1].strip() == "changed params: tokenize.max_length"
    assert next(ln for ln in lines if ln.startswith("data ")).split()[1] == "cached"

    # a new pipeline run with a different config: not in cache (no baseline of that pipeline)
    statuses = pipeline_status(GRAPH.plan(load_pipeline("tiny-billsum"), Store(store)), Store(store))
    assert {s.status for s in statuses} == {"missing"} and statuses[0].reasons == ["not in cache"]


def test_show_and_path(env, capsys):
    config, store = env
    rc, out = inspect(capsys, "path", PIPELINE, "train", "--config", str(config))
    assert rc == 0 and Path(out.strip()).parent == store / "train" and (Path(out.strip()) / "loss.png").is_file()
    rc, out = inspect(capsys, "show", PIPELINE, "data", "--config", str(config))
    manifest = json.loads(out)
    assert manifest["stage"] == "data" and manifest["metrics"]["rows"]["train"] == 40
    assert inspect(capsys, "path", "tiny-billsum", "data", "--config", str(config))[0] == 1  # missing
    assert inspect(capsys, "show", PIPELINE, "nope", "--config", str(config))[0] == 2  # unknown stage


def test_gc_dry_run_lists_only_unreachable(env, capsys):
    config, store_root = env
    store = Store(store_root)
    cfg = load_pipeline(PIPELINE, ["tokenize.max_length=64"], config)
    run_pipeline(cfg, store, until="tokenize")  # an artifact no pipeline's current config reaches
    orphan = plan(cfg)[1].key.key
    (store_root / ".work" / f"train-{'e' * 64}").mkdir(parents=True)  # a dead run's scratch
    before = sorted(p.relative_to(store_root) for p in store_root.rglob("*"))

    # --current-only: only the current keys of the file's pipelines are reachable
    rc, out = inspect(capsys, "gc", "--config", str(config), "--current-only", "--json")
    report = json.loads(out)
    assert rc == 0 and report["dry_run"]
    assert [(g["kind"], g["stage"], g["key"]) for g in report["items"]] == [
        ("artifact", "tokenize", orphan), ("work", "train", "e" * 64)]
    assert not any(g["removed"] for g in report["items"])
    assert sorted(p.relative_to(store_root) for p in store_root.rglob("*")) == before  # dry run: untouched

    # by default what each pipeline last ran (its ref: the max_length=64 tokenize) is kept, --config or not
    rc, out = inspect(capsys, "gc", "--config", str(config), "--json")
    assert [g["stage"] for g in json.loads(out)["items"]] == ["train"]
    rc, out = inspect(capsys, "gc", "--json")
    assert orphan not in out

    # until the pipeline's last run is dropped on purpose
    assert inspect(capsys, "gc", "--drop", "nope", "--json")[0] == 2
    rc, out = inspect(capsys, "gc", "--config", str(config), "--drop", PIPELINE, "--force", "--min-age", "0")
    assert rc == 0 and "removed 2 of 2" in out
    assert not (store_root / "tokenize" / orphan).exists()
    assert not (store_root / ".work" / f"train-{'e' * 64}").exists()
    assert {s.status for s in pipeline_status(GRAPH.plan(load_pipeline(PIPELINE, None, config), store), store)} == {"cached"}
    assert inspect(capsys, "gc", "--config", str(config), "--json")[1].count('"kind"') == 0


def test_cli_runs_nothing_and_never_imports_prefect(env):
    config, store = env
    events = len(Store(store).events())
    code = ("import runpy, sys\n"
            "sys.argv = ['flows.inspect', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('flows.inspect', run_name='__main__')\n"
            "except SystemExit as e:\n    rc = e.code\n"
            "print('PREFECT_IMPORTED' if any(m.split('.')[0] == 'prefect' for m in sys.modules) else 'NO_PREFECT')\n"
            "sys.exit(rc)\n")
    res = subprocess.run([sys.executable, "-c", code, "status", PIPELINE, "--config", str(config),
                          "--set", "train.lr=0.01"], cwd=ROOT, env=subprocess_env(store), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1, res.stderr
    assert "changed params: train.lr" in res.stdout and res.stdout.strip().endswith("NO_PREFECT")
    res = subprocess.run([sys.executable, "-m", "flows.inspect", "status", "no-such-pipeline"], cwd=ROOT,
                         env=subprocess_env(store), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.startswith("error: unknown pipeline")
    assert len(Store(store).events()) == events  # nothing ran


def test_why_changed_names_each_kind_of_input():
    from stages.engine.status import why_changed

    sk = next(i.key for i in plan(load_pipeline("tiny-imdb")) if i.stage.name == "train")
    old = {**sk.key_inputs(), "code_objects": list(sk.code_objects)}
    assert why_changed(old, sk) == ["changed key (no recorded input differs; manifest from an older store "
                                    "format?)"]
    lib = next(iter(sk.libraries))
    old = {**old, "params": {**sk.params, "train": {**sk.params["train"], "lr": 0.5}},
           "upstream": {**sk.upstream, "model": "0" * 64}, "code": "old", "code_objects": ["stages.train.gone"],
           "libraries": {**sk.libraries, lib: "0.0.1"}, "inputs": {"imdb/train.csv.gz": "x"}}
    reasons = why_changed(old, sk)
    assert reasons[0] == "changed params: train.lr"
    assert reasons[1] == "changed upstream: model"
    assert reasons[2] == "changed deps: imdb/train.csv.gz (deleted)"
    assert reasons[3].startswith("changed code: ") and "-stages.train.gone" in reasons[3]
    assert reasons[4] == f"changed libraries: {lib} 0.0.1 -> {sk.libraries[lib]}"
    # an edited function (same name, other source hash) is named as modified
    edited = [o if not o.startswith("stages.train.run:") else "stages.train.run:000000000000"
              for o in sk.code_objects]
    reasons = why_changed({**sk.key_inputs(), "code": "old", "code_objects": edited}, sk)
    assert reasons == ["changed code: stages.train.run (modified)"]


def test_shared_fsspec_store(env, tmp_path, monkeypatch, capsys):
    """status and gc on a shared store URL (fsspec memory://, standing in for s3:// / gs://)."""
    import uuid

    from stages.engine.remote_store import open_store

    config, _ = env
    url = f"memory://inspect-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("FINETUNE_STORE", url)
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    store = open_store()
    run_pipeline(load_pipeline(PIPELINE, None, config), store, until="tokenize")
    other = load_pipeline(PIPELINE, ["tokenize.max_length=64"], config)
    run_pipeline(other, store, until="tokenize")
    orphan = next(i.key.key for i in plan(other) if i.stage.name == "tokenize")

    rc, out = inspect(capsys, "status", PIPELINE, "--config", str(config), "--json")
    report = json.loads(out)
    by = {s["stage"]: s for s in report["stages"]}
    assert rc == 1 and report["store"] == url
    assert by["data"]["status"] == by["tokenize"]["status"] == "cached" and by["model"]["status"] == "missing"
    assert by["tokenize"]["path"] == f"{url}/tokenize/{by['tokenize']['key']}"

    # each run is a result, recorded in the shared store itself: gc on any machine keeps both
    assert sorted(r["set"] for _, r in store.results()) == [[], ["tokenize.max_length=64"]]
    assert len(store.fs.ls(store._r("results"))) == 2
    rc, out = inspect(capsys, "gc", "--config", str(config), "--json")
    assert json.loads(out)["items"] == []
    rc, out = inspect(capsys, "gc", "--config", str(config), "--current-only", "--json")
    assert [(g["stage"], g["key"]) for g in json.loads(out)["items"]] == [("tokenize", orphan)]
    rc, out = inspect(capsys, "gc", "--config", str(config), "--drop", PIPELINE, "--force", "--min-age", "0")
    assert "removed 1 of 1" in out and store.problems("tokenize", orphan) == ["not in store"]
    assert store.ref_names() == [] and store.results() == []  # dropped on the shared store
    assert store.problems("tokenize", by["tokenize"]["key"]) == []


def test_runs_lists_every_run_with_its_set_list_stage_outcomes_and_metrics(env, capsys, monkeypatch):
    """`inspect runs`: the module's full run, a rerun with an evaluation change (only evaluate computes),
    a run of a sweep (all cached) and a run stopped by a failing stage, each with what it did."""
    config, store = env
    before = len(json.loads(inspect(capsys, "runs", PIPELINE, "--json")[1]))
    run_pipeline(load_pipeline(PIPELINE, ["evaluate.max_examples=4"], config), Store(store))
    monkeypatch.setenv("FINETUNE_SWEEP", "my-sweep")
    run_pipeline(load_pipeline(PIPELINE, None, config), Store(store))
    monkeypatch.delenv("FINETUNE_SWEEP")

    real_step = runner.run_step

    def evaluate_breaks(plan, item, *args, **kwargs):
        if item.stage.name == "evaluate":
            raise RuntimeError("disk on fire")
        return real_step(plan, item, *args, **kwargs)

    monkeypatch.setattr(runner, "run_step", evaluate_breaks)
    with pytest.raises(RuntimeError):
        run_pipeline(load_pipeline(PIPELINE, ["evaluate.max_examples=3"], config), Store(store))
    monkeypatch.undo()

    rc, out = inspect(capsys, "runs", PIPELINE, "--json")
    runs = json.loads(out)
    assert rc == 0 and len(runs) == before + 3
    first, changed, swept, failed = runs[0], *runs[-3:]
    assert set(first["stages"].values()) == {"computed"} and first["status"] == "completed"
    assert first["train_seconds"] > 0 and "splits.test.accuracy" in first["metrics"]
    assert changed["set"] == ["evaluate.max_examples=4"] and changed["status"] == "completed"
    assert [s for s, v in changed["stages"].items() if v == "computed"] == ["evaluate", "export"]  # export follows evaluate (its card)
    assert swept["sweep"] == "my-sweep" and set(swept["stages"].values()) == {"cached"}
    assert failed["status"] == "failed" and failed["stages"]["evaluate"] == "failed"
    assert "disk on fire" in failed["error"]

    assert [r["id"] for r in json.loads(inspect(capsys, "runs", "--sweep", "my-sweep", "--json")[1])] == [swept["id"]]
    rc, text = inspect(capsys, "runs", PIPELINE)
    lines = text.splitlines()
    assert rc == 0 and lines[0].split()[:3] == ["started", "pipeline", "stages"]
    marks = "".join("C" if v == "computed" else "c" for v in changed["stages"].values())
    assert f" {marks} " in lines[-4] and lines[-4].endswith("evaluate.max_examples=4")
    assert "small [my-sweep]" in lines[-3] and "failed" in lines[-2]
    rc, table = inspect(capsys, "runs", PIPELINE, "--csv")
    assert rc == 0 and table.splitlines()[0].startswith("started,id,pipeline,sweep,status,set,data,")
    assert len(table.splitlines()) == len(runs) + 1


def test_status_prints_the_command_that_runs_what_is_stale_as_given(env, capsys):
    """The `run:` line repeats --config and the --set list: parsed as printed, it loads the config whose
    keys the status table showed (the same keys, so running it computes exactly the stale stages)."""
    import shlex

    from stages.engine.cli import parser

    config, store = env
    sets = ["tokenize.max_length=64", "data.subset={train: 40, validation: 8, test: 8}"]
    rc, out = inspect(capsys, "status", PIPELINE, "--config", str(config), *(a for s in sets for a in ("--set", s)))
    assert rc == 1
    line = next(ln for ln in out.splitlines() if ln.startswith("run: "))
    argv = shlex.split(line.removeprefix("run: "))
    assert argv[:3] == ["finetune", "run", PIPELINE]
    assert argv[3:] == ["--config", str(config.resolve()), *(a for s in sets for a in ("--set", s))]
    cfg = GRAPH.load(parser("finetune run").parse_args(argv[2:]))
    shown = {s["stage"]: s["key"] for s in json.loads(inspect(capsys, "status", PIPELINE, "--config", str(config),
                                                              *(a for s in sets for a in ("--set", s)),
                                                              "--json")[1])["stages"]}
    assert {i.stage.name: i.key.key for i in plan(cfg)} == shown
    rc, out = inspect(capsys, "status", PIPELINE, "--config", str(config))
    assert rc == 0 and "run: " not in out  # nothing to run: no command
