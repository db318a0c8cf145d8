"""The project's Prefect defaults, set before Prefect is first imported unless the user already set them:
PREFECT_HOME inside the project (git-ignored; an installed wheel: .prefect/ in the current directory), a server startup timeout that covers a first start on a slow
machine (24-30 s measured; Prefect's default is 20 s), the temporary server on loopback, analytics off.

Also the `finetune` logger at INFO: Prefect copies a handler to an extra logger but not a level, so under
Prefect's logging.yml (root at WARNING) every INFO line of a stage (the train stage's step lines, its
summary) was dropped before any handler saw it. flows/orchestration/stage_logs.py gives that logger
Prefect's API handler.
"""

from __future__ import annotations

import logging
import os

from stages.engine.paths import work_root

PREFECT_DEFAULTS = {
    "PREFECT_HOME": str(work_root() / ".prefect"),
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_API_HOST": "127.0.0.1",
    "DO_NOT_TRACK": "1",
}


def use_project_defaults() -> None:
    """Idempotent; a value already in the environment wins."""
    for name, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(name, value)
    if logging.getLogger("finetune").level == logging.NOTSET:
        logging.getLogger("finetune").setLevel(logging.INFO)
