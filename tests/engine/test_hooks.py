"""The one loop's hooks (stages/engine/plan.py `Hook`, runner.py `Execution`): the engine's own (run records),
the project's, then the driver's, each at its point and in that order, on a run that finishes, one that is
cached and one that fails. A graph of two plain Python stages: no model, under a second."""

from __future__ import annotations

import json
from typing import Any

import pytest

from stages.engine.errors import DataError
from stages.engine.hooks import Hook, Run
from stages.engine.plan import Graph, Planned, Project
from stages.engine.runner import execute
from stages.engine.stage import Stage, StageContext
from stages.engine.store import Outcome, Store
from stages.pipeline.loading import SCHEMA, load_pipeline


def first(ctx: StageContext[Any]) -> dict[str, Any]:
    (ctx.out_dir / "name.txt").write_text(ctx.cfg.name)
    return {"rows": 1}


def second(ctx: StageContext[Any]) -> dict[str, Any]:
    if ctx.cfg.description == "fail":
        raise DataError("second: told to fail")
    (ctx.out_dir / "copy.txt").write_text((ctx.upstream["first"] / "name.txt").read_text())
    return {"copied": True}


class Recorder(Hook):
    def __init__(self, who: str, events: list[tuple[Any, ...]]):
        self.who, self.events = who, events

    def before_run(self, run: Run) -> None:
        self.events.append((self.who, "before_run", sorted(run.tags)))

    def before_stage(self, run: Run, item: Planned) -> None:
        self.events.append((self.who, "before_stage", item.name))

    def after_stage(self, run: Run, outcome: Outcome) -> None:
        self.events.append((self.who, "after_stage", outcome.stage, outcome.computed))

    def on_error(self, run: Run, stage: str | None, error: BaseException) -> None:
        self.events.append((self.who, "on_error", stage, str(error)))

    def after_run(self, run: Run, status: str) -> None:
        self.events.append((self.who, "after_run", status, len(run.outcomes)))


def graph(events: list[tuple[Any, ...]]) -> Graph[Any]:
    stages = [Stage(name="first", body=first, reads=("name",), libraries=()),
              Stage(name="second", body=second, reads=("description",), upstream=("first",), libraries=())]
    return Graph(stages, Project(SCHEMA, hooks=lambda: [Recorder("project", events)]))


def runs_of(store: Store) -> list[dict[str, Any]]:
    records = [json.loads(p.read_text()) for p in (store.root / "runs").glob("*.json")]
    return sorted(records, key=lambda r: r["started"])  # file names order runs of one second at random


def test_each_hook_at_its_point_engine_then_project_then_driver(tmp_path):
    events: list[tuple[Any, ...]] = []
    store, g = Store(tmp_path / "store"), graph(events)
    cfg = load_pipeline("tiny-imdb", ["description=ok"])
    execute(g.plan(cfg, store), store, hooks=[Recorder("driver", events)])
    tags = ["finetune.run_record", "finetune.store"]  # the run record's hook ran first and added its id
    assert events == [
        ("project", "before_run", tags), ("driver", "before_run", tags),
        ("project", "before_stage", "first"), ("driver", "before_stage", "first"),
        ("project", "after_stage", "first", True), ("driver", "after_stage", "first", True),
        ("project", "before_stage", "second"), ("driver", "before_stage", "second"),
        ("project", "after_stage", "second", True), ("driver", "after_stage", "second", True),
        ("project", "after_run", "FINISHED", 2), ("driver", "after_run", "FINISHED", 2)]
    events.clear()
    execute(g.plan(cfg, store), store)  # a rerun: both store hits, the project's hook alone
    assert [e for e in events if e[1] == "after_stage"] == [("project", "after_stage", "first", False),
                                                             ("project", "after_stage", "second", False)]
    assert [(r["status"], [s["status"] for s in r["stages"]]) for r in runs_of(store)] == [
        ("completed", ["computed", "computed"]), ("completed", ["cached", "cached"])]


def test_a_failing_stage_reaches_on_error_then_after_run_failed(tmp_path):
    events: list[tuple[Any, ...]] = []
    store, g = Store(tmp_path / "store"), graph(events)
    with pytest.raises(DataError, match="told to fail"):
        execute(g.plan(load_pipeline("tiny-imdb", ["description=fail"]), store), store)
    assert events[-3:] == [("project", "before_stage", "second"),
                           ("project", "on_error", "second", "second: told to fail"),
                           ("project", "after_run", "FAILED", 1)]
    (record,) = runs_of(store)
    assert record["status"] == "failed" and record["stages"][-1] == {"stage": "second", "status": "failed"}
