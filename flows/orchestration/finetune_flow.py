"""The `finetune` flow: one Prefect task per step of a pipeline's plan, each run through the store. A
stage whose key the store already holds finishes in state `Cached` without running its body. Tasks pass
artifact paths and manifests, never models or data.

The flow drives the engine's loop (stages/engine/runner.py `Execution`: the order, the run record, the result
record, tracking, all as for `python -m stages`) and adds its own hooks: the stage lines in the run's log and
the UI's artifacts (ui_artifacts.py). It receives its plan from the command line that made it (`plan`);
a run with parameters only (a deployment's, a sweep's child) plans the same way (stages/graph.py plan_run)."""

from __future__ import annotations

import atexit
import functools
import gc
from typing import Any, cast

from prefect import Task, flow, task
from prefect.cache_policies import NONE
from prefect.context import FlowRunContext
from prefect.states import Completed, Failed, State
from prefect.utilities.annotations import quote

from flows.orchestration import api_watch
from flows.orchestration.run_owner import claim_and_reap, current_flow_run_id
from flows.orchestration.stage_logs import route_logs
from flows.orchestration.ui_artifacts import UIArtifacts
from stages.engine.cli import Lines
from stages.engine.errors import ConfigError, FinetuneError
from stages.engine.plan import Plan, Planned
from stages.engine.remote_store import open_store
from stages.engine.runner import Execution, run_step
from stages.engine.stage import JOINED
from stages.engine.store import Outcome, Store
from stages.graph import plan_run

# at exit, no last garbage collection over the millions of objects torch and transformers leave: a run's
# process (a worker's, a sweep's child) ends about 1.5 s sooner (bench/run_overhead.py: 1.73 s -> 0.18 s)
atexit.register(gc.freeze)


def user_error(e: FinetuneError) -> State:
    """A run or stage that ends on a user error: one line in the log and the UI, no traceback."""
    return Failed(message=f"{type(e).__name__}: {e}", data=e)


def stage_task(plan: Plan, item: Planned, store: Store, done: dict[str, Outcome]) -> Outcome | State:
    try:
        outcome = run_step(plan, item, store, done)
    except FinetuneError as e:
        return user_error(e)
    if outcome.reason == JOINED:  # trained with another machine, which commits and publishes the artifact
        return Completed(name="Joined", message=outcome.manifest.get("role"), data=outcome)
    if not outcome.computed:
        return Completed(name="Cached", message=f"store hit {outcome.key[:12]}", data=outcome)
    return outcome


# log_prints off in the stage tasks: stage bodies log, they do not print, and with Prefect's print patch a
# library that captures its own output (dill disassembling a function for `datasets`' fingerprints, under
# the evaluate stage's `evaluate` modules) would spill it into the run's logs
@functools.cache
def stage_task_named(name: str) -> Task[..., Outcome | State]:
    """The task of a stage of a plan's graph (named after the stage: the UI's task runs)."""
    return task(name=name, cache_policy=NONE, log_prints=False)(stage_task)


@flow(name="finetune", log_prints=True)
def finetune(pipeline: str, overrides: dict[str, Any] | list[str] | None = None, only: str | None = None,
             force: list[str] | None = None, verify: bool = False, until: str | None = None,
             config: str | None = None, plan: Any = None) -> list[dict[str, Any]] | State:
    """Run a named pipeline of pipeline.yaml (or `config`). overrides: {"train.lr": 1e-4} or ["train.lr=1e-4"].
    `plan`: the Plan of these parameters, made by the command line that starts the flow (else made here). Typed
    Any: Prefect would otherwise build a pydantic schema of the plan's dataclasses (and a deployment's form)."""
    route_logs()
    api_watch.attach(str(FlowRunContext.get().client.api_url))
    flow_run_id = current_flow_run_id()
    claim_and_reap(flow_run_id)
    store = open_store()
    try:
        if plan is not None and not isinstance(plan, Plan):
            raise ConfigError("plan: made by the command line that starts the flow; leave it out of a run's "
                              "parameters")
        plan = plan or plan_run(store, pipeline, overrides, config, only=only, until=until, force=force or [],
                                verify=verify)
        run = Execution(plan, store, {"finetune.prefect.flow_run_id": str(flow_run_id)} if flow_run_id else None,
                        hooks=[Lines(print), UIArtifacts()])
    except FinetuneError as e:  # an unknown stage name, --only without its upstream: one line, as a stage's
        return user_error(e)
    states: dict[str, State] = {}
    gone = ""  # the last line when the Prefect server is gone (api_watch): the run then ends past Prefect
    with run:
        for item in run.pending():
            if api_watch.gone():  # the run cannot be recorded: it stops here, what it committed stays
                gone = api_watch.gone_line([o.stage for o in run.outcomes], item.name, plan.run_command())
                run.fail(gone)
                break
            # quoted: Prefect would otherwise walk the plan, the store and every manifest so far looking for
            # futures (18 ms a task, bench/run_overhead.py); they hold none
            state = states[item.name] = stage_task_named(item.name)(quote(plan), quote(item), quote(store),
                                                                    quote(run.done), return_state=True)
            if state.is_failed():
                run.fail(state.message or "failed")
                if api_watch.gone():
                    api_watch.leave(2, f"error: stage {item.name}: {state.message}",
                                    f"error: {api_watch.gone_line([], finished=False)}")
                return Failed(message=f"stage {item.name}: {state.message}")
            run.finished(cast(Outcome, state.result()))
        if not gone and api_watch.gone():
            gone = api_watch.gone_line([])
    if gone and (line := run.transfer_line()):  # else the run's Lines hook printed it
        print(line)
    if gone:  # past Prefect: its final state and its exit drain would each wait on the dead server
        api_watch.leave(api_watch.EXIT_CODE, f"error: {gone}", f"store: {store}")
    return [{"stage": o.stage, "key": o.key, "path": str(o.path), "computed": o.computed,
             "state": states[o.stage].name, "duration_s": o.manifest.get("duration_s")} for o in run.outcomes]
