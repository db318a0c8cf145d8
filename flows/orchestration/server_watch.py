"""`python flows/orchestration/server_watch.py PARENT_PID uvicorn ARGS...`: Prefect's temporary server, stopped when the
command that started it is gone, even by `kill -9` (which runs no exit hook of the command's).

Prefect starts the temporary server as `python -m uvicorn ...`; compat_prefect.py starts it through this file
instead. A daemon thread polls the parent: once the parent is gone (this process re-parented), it asks the
server to stop (SIGTERM: uvicorn's graceful shutdown) and ends the process 5 s later if it is still there.
Polling, not prctl(PR_SET_PDEATHSIG): that signal follows the *thread* that started the process, and
Prefect may start its server from a worker thread that ends long before the command does.

Before the server starts, its database is prepared once per Prefect version and home, under a file lock in
PREFECT_HOME (compat_prefect.FIRST_START): commands started at once on a fresh home each start a temporary
server, and their concurrent first starts raced (migrations, block registration: tracebacks).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

from flows.orchestration.compat_prefect import prepare_database_once

POLL_S = 0.5
GRACE_S = 5.0


def watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os._exit(1)


def main() -> None:
    parent, module, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    threading.Thread(target=watch, args=(parent,), daemon=True, name="parent-watch").start()
    prepare_database_once()
    sys.argv = [module, *args]
    sys.path[0] = os.getcwd()  # as `python -m` has it (not this file's folder)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
