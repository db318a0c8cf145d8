"""Prefect flows. Importing this package sets Prefect defaults that work on a fresh machine, unless the
user already set them: PREFECT_HOME inside the project (git-ignored), a server startup timeout that
covers a first start on a slow machine (24-30 s measured; Prefect's default is 20 s), analytics off.

Stage log lines (loggers `finetune.*`) reach the console and the Prefect UI. They used not to under
Prefect: PREFECT_LOGGING_EXTRA_LOGGERS=finetune (set here until issue 15) gave the `finetune` logger
Prefect's API handler, but Prefect copies only the handler, not a level, so the logger inherited the
root's WARNING (Prefect's logging.yml) and every INFO line (the train stage's step lines, its summary) was
dropped before any handler saw it; and a process that imported Prefect before this package never got the
handler. Now the level is INFO here, and flows/flow.py gives the logger its API handler (records made in a
run only) in every process that imports it, a deployment's flow-run process included; by propagation the
lines also reach Prefect's console handler on the root logger.
"""

import logging
import os
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent

for _name, _value in {
    "PREFECT_HOME": str(_ROOT / ".prefect"),
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_API_HOST": "127.0.0.1",
    "DO_NOT_TRACK": "1",
}.items():
    os.environ.setdefault(_name, _value)

if logging.getLogger("finetune").level == logging.NOTSET:
    logging.getLogger("finetune").setLevel(logging.INFO)
