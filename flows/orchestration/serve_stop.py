"""How `finetune serve` (`python -m flows.serve`) serves and stops: Ctrl-C (SIGINT) and SIGTERM the same way, within seconds.

Why it used to hang (issue 15): a process started in the background of a non-interactive shell (a CI job,
a script's `cmd &`, an agent's shell) inherits SIGINT *ignored*, and Python then installs no
KeyboardInterrupt handler: Ctrl-C / `kill -INT` did nothing at all, and a test waiting for serve to exit
timed out. SIGTERM reached Prefect's runner, whose graceful stop (cancel runs, stop polling, pause every
deployment, close its clients) has no deadline: under load it took 7+ s and longer with a run to kill.

Now both signals go to one handler: the first starts the runner's graceful stop (a run in progress gets
SIGTERM and the state Cancelled; polling stops; deployments are paused) and arms a deadline; if serving
has not returned by then, whatever still runs is killed and marked Crashed through the API, and the
process exits. A second signal stops at once the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from typing import Any

from flows.orchestration.compat_prefect import (
    runner_is_serving,
    runner_processes,
    runner_with_sigterm_handler,
    stop_runner_in_background,
)

STOP_WITHIN_S = 6.0  # the graceful stop's deadline: flows.serve is gone within ~7 s of the signal, loaded or not


class Stopper:
    """The SIGINT / SIGTERM handler of flows.serve (see the module docstring)."""

    def __init__(self, api_url: str | None = None):
        self.api_url = api_url
        self.runner: Any = None  # set once serving starts
        self.signals = 0
        self.timer: threading.Timer | None = None
        self.caught: dict[str, int] = {}  # flow run id -> pid of the runs in progress when the signal came

    def install(self) -> None:
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)

    def __call__(self, signum: int, frame: object) -> None:
        self.signals += 1
        runner = self.runner
        if not runner_is_serving(runner):
            raise KeyboardInterrupt  # not serving yet (registering deployments): nothing to stop gracefully
        self.caught.update(runner_processes(runner))
        if self.signals > 1:
            self.force("a second signal")
            return
        print(f"flows.serve: stopping (runs in progress are cancelled; forced after {STOP_WITHIN_S:.0f} s)",
              flush=True)
        self.timer = threading.Timer(STOP_WITHIN_S, self.force, args=(f"the graceful stop took over "
                                                                      f"{STOP_WITHIN_S:.0f} s",))
        self.timer.daemon = True
        self.timer.start()
        stop_runner_in_background(runner)

    def settle(self) -> int:
        """Kill the flow-run processes still alive (those in progress at the signal and those the runner
        still tracks) and mark each run Crashed unless it reached a final state. How many were marked."""
        runs = {**self.caught, **dict(runner_processes(self.runner))}
        for pid in runs.values():
            kill_tree(pid)
        return sum(mark_crashed(self.api_url, flow_run_id) for flow_run_id in runs)

    def force(self, why: str) -> None:
        """Settle the runs in progress and exit now."""
        marked = self.settle()
        print(f"flows.serve: stopped ({why}; {marked} run(s) left running marked Crashed)", flush=True)
        os._exit(0)


def kill_tree(pid: int) -> None:
    """SIGKILL a flow-run process and its process group (the runner starts each in its own group)."""
    with contextlib.suppress(OSError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
            return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def mark_crashed(api_url: str | None, flow_run_id: str) -> bool:
    """Set the run Crashed unless it already reached a final state (the graceful stop may have set
    Cancelled, or the run itself Crashed). Whether it was marked."""
    if not api_url:
        return False
    import httpx

    url = f"{api_url.rstrip('/')}/flow_runs/{flow_run_id}"
    state = {"type": "CRASHED", "name": "Crashed", "message": "flows.serve stopped while the run was in progress; "
             "committed stages stay in the store and the next run reuses them"}
    try:
        current = (httpx.get(url, timeout=3).json().get("state") or {}).get("type")
        if current in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED"):
            return False
        httpx.post(f"{url}/set_state", json={"state": state, "force": True}, timeout=3)
        return True
    except (httpx.HTTPError, ValueError):
        return False


def serve_until_stopped(deployments: list[Any], limit: int, api_url: str) -> None:
    """prefect.serve's runner, stopped by a Stopper; returns once serving has stopped."""
    stopper = Stopper(api_url)
    runner = runner_with_sigterm_handler(lambda: stopper(signal.SIGTERM, None), limit=limit,
                                         pause_on_shutdown=True)
    for d in deployments:
        runner.add_deployment(d)
    stopper.runner = runner
    stopper.install()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(runner.start())
    if stopper.timer is not None:
        stopper.timer.cancel()
    # the graceful stop returned: a run it sent SIGTERM may not have reported its state yet
    stopper.settle()
