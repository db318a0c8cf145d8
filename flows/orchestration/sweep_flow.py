"""The `sweep` flow: one child flow run of `finetune` (flows/orchestration/finetune_flow.py) per variant and
seed, all through the same store, at most `parallel` at once. Prefect schedules them: every run is a `variant`
task submitted at once to a `ThreadPoolTaskRunner(max_workers=parallel)`, which runs `parallel` and holds the
others Pending. Each child runs in its own process (Prefect's `run_flow_in_subprocess`, a fresh spawned
process per run: a process-pool task runner would reuse its processes): training seeds torch's process-wide
RNG, so two trainings must never share a process. Prefect does not end those processes when the sweep is
interrupted (its task runner cancels only tasks not yet started), so Ctrl-C / SIGTERM ends them here
(_stop_children). A stage whose key two runs share (data, tokenize, model, adapters when only train.*
varies) is computed by the first and a store hit for the others; the store's per-key lock makes a second run
wait for the first rather than compute it again.

When the runs are done the flow publishes the comparison (flows/reports/comparison.py) as a table artifact `sweep-<name>`
and a chart (metric per variant, loss curves overlaid) as a PNG in the sweep's folder of the store, linked from
the markdown artifact `sweep-<name>-chart`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client
from prefect.context import TaskRunContext
from prefect.flow_engine import run_flow_in_subprocess
from prefect.futures import wait
from prefect.states import Failed, State
from prefect.task_runners import ThreadPoolTaskRunner

from flows.orchestration.compat_prefect import literal_task_run_name, wait_for_task_run
from flows.orchestration.finetune_flow import finetune, user_error
from flows.orchestration.run_owner import claim_and_reap, current_flow_run_id
from flows.orchestration.stage_logs import route_logs
from flows.orchestration.ui_artifacts import artifact_key
from flows.reports import comparison, sweep_outputs
from flows.reports.variants import Run, Sweep, from_spec, named_sweep
from stages.engine.config import DEFAULT_PIPELINE_FILE
from stages.engine.errors import FinetuneError
from stages.engine.remote_store import open_store
from stages.engine.runs import SWEEP_ENV
from stages.pipeline.tracking import Tracker, child_env, start_sweep

log = logging.getLogger("finetune.sweep")


# how often a variant on the work pool asks the server whether its run ended: one request a second per variant
# in flight (Prefect's default is 5 s: a sweep's last run would end up to 5 s before the sweep notices, and a
# --parallel slot stays taken as long)
DEPLOYMENT_POLL_S = 1.0
_CHILDREN: set[Any] = set()  # the child processes running now (ended when the sweep is interrupted)
_STOPPING = threading.Event()  # set when the sweep is interrupted: no child starts after it
_CHILDREN_LOCK = threading.Lock()


class ChildRunFailed(Exception):
    """A variant's child flow run ended in a state other than Completed."""


def _stop_children(grace_s: float = 15) -> None:
    """Ctrl-C / SIGTERM reach the sweep's main thread, not the threads waiting on children: end the children,
    which resume from their checkpoints on the next run. A child still alive after `grace_s` is killed: the
    signal can land while the child runs a finalizer, where Python drops the exception it raises (seen: a
    child trained on and the sweep waited for it)."""
    with _CHILDREN_LOCK:
        _STOPPING.set()
        procs = list(_CHILDREN)
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5)


@task(name="variant", cache_policy=NONE)
def run_child(sweep_name: str, run: Run, config: str, api_url: str, on_workers: bool = False,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Create the child flow run (linked to this task run, so the UI nests it under the sweep) and run it in
    a process of its own, or (on_workers) as a run of the `finetune/<pipeline>` deployment that a work pool's
    worker picks up; its outcome is the flow run's final state. `env`: the child's MLflow run name and parent."""
    params = {"pipeline": run.cfg.name, "overrides": run.overrides, "config": config}
    env = {SWEEP_ENV: sweep_name, **(env or {})}  # its results are the sweep's (gc keeps them until it is dropped)
    if on_workers:
        from prefect.deployments import run_deployment

        default = config == str(DEFAULT_PIPELINE_FILE)  # a worker reads its own checkout's pipeline.yaml
        fr: Any = run_deployment(f"finetune/{run.cfg.name}", parameters={**params, "config": None if default else config},
                                 flow_run_name=f"{sweep_name}: {run.label}", tags=["sweep", sweep_name], timeout=None,
                                 job_variables={"env": env}, poll_interval=DEPLOYMENT_POLL_S)
        return _outcome(run, fr.name, fr.state, None)
    parent = TaskRunContext.get().task_run.id
    with get_client(sync_client=True) as client:
        wait_for_task_run(client, parent)
        child = client.create_flow_run(finetune, name=f"{sweep_name}: {run.label}", parameters=params,
                                       parent_task_run_id=parent,
                                       tags=["sweep", sweep_name])
    with _CHILDREN_LOCK:  # a task the runner started just before an interrupt must not start its child
        if _STOPPING.is_set():
            raise ChildRunFailed("the sweep was interrupted before this run started")
        # a context without the parent's settings: the child reaches the same API through PREFECT_API_URL
        proc = run_flow_in_subprocess(finetune, flow_run=child, parameters=params,
                                      context={"tags_context": {"current_tags": ["sweep", sweep_name]}},
                                      env={"PREFECT_API_URL": api_url, **env})
        _CHILDREN.add(proc)
    try:
        proc.join()
    finally:
        _CHILDREN.discard(proc)
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(child.id).state
    return _outcome(run, child.name, state, proc.exitcode)


def _outcome(run: Run, flow_run: str, state: State | None, exitcode: int | None) -> dict[str, Any]:
    if state is not None and state.is_completed():
        return {"run": run.label, "flow_run": flow_run, "state": state.name, "exitcode": exitcode}
    if state is None or not state.is_final():  # the process died before the engine recorded an end
        raise ChildRunFailed(f"its process exited with code {exitcode} while the run was "
                             f"{state.name if state else 'not started'}; its traceback is in this flow's output")
    raise ChildRunFailed(f"{state.name}: {state.message}")


@flow(name="sweep", log_prints=True)
def run_sweep(name: str, parallel: int = 1, config: str | None = None, spec: dict[str, Any] | None = None,
              on_workers: bool = False) -> list[dict[str, Any]] | State:
    """Run the sweep `name` of pipeline.yaml (or `config`), or the ad-hoc sweep `spec` (a sweeps: entry as a
    mapping: pipeline, grid or variants, set, seeds, metric, mode), at most `parallel` child runs at once.
    on_workers: each child is a run of the `finetune/<pipeline>` deployment (a work pool spreads them over
    its workers) instead of a process beside this flow."""
    route_logs()
    config = config or str(DEFAULT_PIPELINE_FILE)
    claim_and_reap(current_flow_run_id())
    try:
        sw = from_spec(name, spec, config) if spec else named_sweep(name, config)
    except FinetuneError as e:
        return user_error(e)
    with get_client(sync_client=True) as client:
        api_url = str(client.api_url)
    print(f"sweep {sw.name}: {len(sw.runs)} runs of {sw.config.pipeline} ({len(sw.variants())} variants"
          f"{f' x {len(sw.config.seeds)} seeds' if sw.config.seeds else ''}), {max(1, parallel)} at a time")
    os.environ[SWEEP_ENV] = sw.name  # the children's run records name their sweep (flows.inspect runs --sweep)
    # MLflow (when tracking is on): a parent run for the sweep, each child's run nested under it
    tracker = start_sweep(sw.runs[0].cfg, sw.name, sw.config.model_dump(mode="json"))
    try:
        results, failed = _run_all(sw, parallel, config, api_url, on_workers, tracker)
    except BaseException:  # interrupted: the parent run ends KILLED, as its children's do
        if tracker is not None:
            tracker.end("KILLED", wait_s=5)
        raise
    finally:
        os.environ.pop(SWEEP_ENV, None)
    files = publish(sw)
    if tracker is not None:
        for f in files.values():
            tracker.artifact(f)
        tracker.end("FAILED" if failed else "FINISHED")
    if failed:
        return Failed(message=f"{len(failed)} of {len(sw.runs)} runs failed: " + "; ".join(failed))
    return results


def _run_all(sw: Sweep, parallel: int, config: str, api_url: str, on_workers: bool,
             tracker: Tracker | None = None) -> tuple[list[dict], list[str]]:
    """Every run as a `variant` task on Prefect's thread-pool task runner, `parallel` at a time, until all
    have finished: (their summaries in the sweep's order, the failures). On an interrupt the children are
    ended first: the runner's exit cancels the tasks not started, then waits for the running ones."""
    _STOPPING.clear()
    runner: Any  # (a ThreadPoolTaskRunner; its generic parameter is the futures' type)
    with ThreadPoolTaskRunner(max_workers=max(1, parallel)) as runner:
        futures = [runner.submit(run_child.with_options(task_run_name=literal_task_run_name(run.label)),
                                 {"sweep_name": sw.name, "run": run, "config": config, "api_url": api_url,
                                  "on_workers": on_workers, "env": child_env(tracker, run.label)})
                   for run in sw.runs]
        try:
            pending: list[Any] = futures
            while pending:  # wait in short slices: a blocking wait would keep Ctrl-C / SIGTERM from the flow
                pending = list(wait(pending, timeout=1).not_done)
        except BaseException:
            _stop_children()
            raise
    results, failed = [], []
    for run, future in zip(sw.runs, futures, strict=True):
        try:
            results.append(future.result())
        except Exception as e:  # noqa: BLE001  (a failed child: the others went on, the sweep fails at the end)
            failed.append(f"{run.label}: {e}")
    return results, failed


def publish(sw: Sweep) -> dict[str, Any]:
    """The comparison table (`sweep-<name>`), the chart in the store and the markdown linking it; returns the
    files written (none when it failed). A UI extra: a failure here is a warning, never a failed sweep."""
    key = artifact_key("sweep", sw.name)
    files: dict[str, Any] = {}
    try:
        result = comparison.compare(sw, open_store())
        create_table_artifact(table=comparison.table_rows(result), key=key,
                              description=f"sweep {sw.name}: {sw.config.description or sw.config.pipeline}, "
                              f"ranked by {sw.config.metric} ({sw.config.mode})")
        files = sweep_outputs.write_outputs(result, open_store())
        create_markdown_artifact(markdown=sweep_outputs.chart_markdown(result, files), key=f"{key}-chart",
                                 description=f"sweep {sw.name}: {sw.config.metric} per variant, loss curves")
    except Exception as e:  # noqa: BLE001
        log.warning("sweep %s: comparison artifacts not published: %s", sw.name, e)
    return files
