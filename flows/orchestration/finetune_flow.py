"""The `finetune` flow: one Prefect task per stage of a named pipeline, each run through the
content-addressed store. A stage whose key is already committed finishes in state `Cached` without
running its body. Tasks pass artifact paths and manifests, never models or data."""

from __future__ import annotations

from typing import Any, cast

from prefect import flow, task
from prefect.cache_policies import NONE
from prefect.states import Completed, Failed, State

from flows.orchestration.run_owner import claim_and_reap, current_flow_run_id
from flows.orchestration.stage_logs import route_logs
from flows.orchestration.ui_artifacts import publish
from stages.engine.cli import describe
from stages.engine.config import DEFAULT_PIPELINE_FILE, load_pipeline
from stages.engine.errors import FinetuneError
from stages.engine.remote_store import open_store
from stages.engine.runner import JOINED, Planned, run_stage
from stages.engine.schema import PipelineConfig
from stages.engine.store import Outcome, Store
from stages.graph import run_pipeline, stage_names


def user_error(e: FinetuneError) -> State:
    """A run or stage that ends on a user error: one line in the log and the UI, no traceback."""
    return Failed(message=f"{type(e).__name__}: {e}", data=e)


def run_one(cfg: PipelineConfig, item: Planned, store: Store, done: dict[str, Outcome], force: bool,
            verify: bool) -> Outcome | State:
    try:
        outcome = run_stage(cfg, item, store, done, force=force, verify=verify)
    except FinetuneError as e:
        return user_error(e)
    if outcome.reason == JOINED:  # trained with another machine, which commits and publishes the artifact
        return Completed(name="Joined", message=outcome.manifest.get("role"), data=outcome)
    if not outcome.computed:  # no upload: the artifacts under its stable keys are still the computed run's
        return Completed(name="Cached", message=f"store hit {outcome.key[:12]}", data=outcome)
    publish(cfg.name, outcome)
    return outcome


# log_prints off in the stage tasks: stage bodies log, they do not print, and with Prefect's print patch a
# library that captures its own output (dill disassembling a function for `datasets`' fingerprints, under
# the evaluate stage's `evaluate` modules) would spill it into the run's logs
STAGE_TASKS = {name: task(name=name, cache_policy=NONE, log_prints=False)(run_one) for name in stage_names()}


class _StageFailed(Exception):
    """A stage's task ended Failed: stops run_pipeline; the flow returns its message as a Failed state."""


@flow(name="finetune", log_prints=True)
def finetune(pipeline: str, overrides: dict[str, Any] | list[str] | None = None, only: str | None = None,
             force: list[str] | None = None, verify: bool = False, until: str | None = None,
             config: str | None = None) -> list[dict[str, Any]] | State:
    """Run a named pipeline of pipeline.yaml (or `config`). overrides: {"train.lr": 1e-4} or ["train.lr=1e-4"]."""
    route_logs()
    cfg = load_pipeline(pipeline, overrides, config or DEFAULT_PIPELINE_FILE)
    claim_and_reap(current_flow_run_id())
    states: dict[str, State] = {}

    def run_task(cfg: PipelineConfig, item: Planned, store: Store, done: dict[str, Outcome], *, force: bool,
                 verify: bool) -> Outcome:
        name = item.stage.name
        state = STAGE_TASKS[name](cfg, item, store, done, force, verify, return_state=True)
        states[name] = state
        if state.is_failed():
            raise _StageFailed(f"stage {name}: {state.message}")
        return cast(Outcome, state.result())

    try:
        outcomes = run_pipeline(cfg, open_store(), only=only, until=until, force=force or [], verify=verify,
                                run=run_task, on_outcome=lambda o: print(describe(o)))
    except _StageFailed as e:
        return Failed(message=str(e))
    except FinetuneError as e:  # an unknown stage name, --only without its upstream: one line, as a stage's
        return user_error(e)
    return [{"stage": o.stage, "key": o.key, "path": str(o.path), "computed": o.computed,
             "state": states[o.stage].name, "duration_s": o.manifest.get("duration_s")} for o in outcomes]
