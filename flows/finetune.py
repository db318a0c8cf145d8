"""The `finetune` flow: one Prefect task per stage of a named pipeline, each run through the
content-addressed store. A stage whose key is already committed finishes in state `Cached` without
running its body. Tasks pass artifact paths and manifests, never models or data.

    python -m flows.finetune PIPELINE [--set train.lr=1e-4] [--only STAGE] [--force STAGE] [--verify]

Importing this module runs flows/__init__.py first, which sets the project's Prefect defaults.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NONE
from prefect.states import Completed, Failed, State

from stages.cli import describe
from stages.config import PipelineConfig, load_pipeline
from stages.errors import FinetuneError
from stages.pipeline import Planned, check_stage_names, plan, run_stage, stage_names, upstream_for_only
from stages.store import Outcome, Store, open_store


def artifact_key(pipeline: str, stage: str) -> str:
    """Stable per pipeline and stage, so the UI shows each stage's history."""
    raw = f"{pipeline}-{stage}".lower()
    return "".join(c if c.isalnum() or c == "-" else "-" for c in raw)


def publish(pipeline: str, o: Outcome) -> None:
    m = o.manifest
    rows = [
        {"field": "status", "value": "computed" if o.computed else "cached"},
        {"field": "key", "value": o.key},
        {"field": "path", "value": str(o.path)},
        {"field": "duration_s", "value": m.get("duration_s")},
        {"field": "size_bytes", "value": sum(f["size"] for f in m.get("files", []))},
    ]
    for name, value in (m.get("metrics") or {}).items():
        if isinstance(value, int | float | str):
            rows.append({"field": name, "value": value})
        elif isinstance(value, dict) and len(str(value)) < 400:
            rows.append({"field": name, "value": str(value)})
    create_table_artifact(table=rows, key=artifact_key(pipeline, o.stage),
                          description=f"{pipeline} / {o.stage}: {'computed' if o.computed else 'cached'}")


def run_one(cfg: PipelineConfig, item: Planned, store: Store, done: dict[str, Outcome], force: bool,
            verify: bool) -> Outcome | State:
    try:
        outcome = run_stage(cfg, item, store, done, force=force, verify=verify)
    except FinetuneError as e:  # a user error: one line in the log and the UI, no traceback
        return Failed(message=f"{type(e).__name__}: {e}", data=e)
    publish(cfg.name, outcome)
    if not outcome.computed:
        return Completed(name="Cached", message=f"store hit {outcome.key[:12]}", data=outcome)
    return outcome


STAGE_TASKS = {name: task(name=name, cache_policy=NONE)(run_one) for name in stage_names()}


@flow(name="finetune", log_prints=True)
def finetune(pipeline: str, overrides: dict[str, Any] | list[str] | None = None, only: str | None = None,
             force: list[str] | None = None, verify: bool = False, until: str | None = None) -> list[dict[str, Any]]:
    """Run a named pipeline of pipeline.yaml. overrides: {"train.lr": 1e-4} or ["train.lr=1e-4"]."""
    cfg = load_pipeline(pipeline, overrides)
    force = force or []
    check_stage_names(force, "force")
    store = open_store()
    items = plan(cfg)
    done = upstream_for_only(items, only, store, verify) if only else {}
    summary = []
    for item in items:
        name = item.stage.name
        if only and name != only:
            continue
        state = STAGE_TASKS[name](cfg, item, store, done, name in force, verify, return_state=True)
        if state.is_failed():
            return Failed(message=f"stage {name}: {state.message}")
        outcome: Outcome = state.result()
        done[name] = outcome
        print(describe(outcome))
        summary.append({"stage": name, "key": outcome.key, "path": str(outcome.path),
                        "computed": outcome.computed, "state": state.name,
                        "duration_s": outcome.manifest.get("duration_s")})
        if name == until:
            break
    return summary


if __name__ == "__main__":
    from flows.cli import main

    sys.exit(main())
