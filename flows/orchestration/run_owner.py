"""A flow run left `Running` or `Pending` by a process that died (`kill -9`, a power cut, an OOM kill) is
marked `Crashed` by the next flow that starts and sees it.

Every finetune/sweep flow run carries the label `finetune.owner` = "HOST:PID:START" (START: the process's
start time, so that a PID the system gave to another process later does not pass as alive). At its start
each flow looks at the runs still Running/Pending with an owner on this host whose process is gone, and
sets them Crashed. Runs owned on another host are left alone: that host's next run will see them.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import psutil

OWNER_LABEL = "finetune.owner"
log = logging.getLogger("finetune.flows")


def process_start(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def owner_of_this_process() -> str:
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{process_start(pid)}"


def owner_is_gone(owner: str) -> bool:
    """True when `owner` names a process of this host that is no longer there (its PID gone or reused)."""
    try:
        host, pid, start = owner.rsplit(":", 2)
        pid_n, start_n = int(pid), int(start)
    except ValueError:
        return False
    if host != socket.gethostname():
        return False
    return process_start(pid_n) != start_n


def current_flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return flow_run.id


def claim_and_reap(flow_run_id: Any) -> list[str]:
    """Label this flow run with its owner; mark Crashed the runs whose owner is gone. Returns their names.
    Bookkeeping only: an API error here is a warning, never the run's end."""
    try:
        return _claim_and_reap(flow_run_id)
    except Exception as e:  # noqa: BLE001
        log.warning("could not record this run's owner or check for dead runs: %s", e)
        return []


def _claim_and_reap(flow_run_id: Any) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    crashed = []
    with get_client(sync_client=True) as client:
        if flow_run_id is not None:
            client.update_flow_run_labels(flow_run_id, {OWNER_LABEL: owner_of_this_process()})
        alive = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
            any_=[StateType.RUNNING, StateType.PENDING])))
        for run in client.read_flow_runs(flow_run_filter=alive):
            owner = (run.labels or {}).get(OWNER_LABEL)
            if run.id == flow_run_id or not isinstance(owner, str) or not owner_is_gone(owner):
                continue
            client.set_flow_run_state(run.id, Crashed(message=f"its process ({owner}) is gone: killed or "
                                                              "crashed without ending the run"), force=True)
            crashed.append(run.name)
    for name in crashed:
        log.warning("flow run %r was left Running by a process that is gone: marked Crashed", name)
    return crashed
