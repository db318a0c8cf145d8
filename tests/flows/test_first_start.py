"""Prefect's first start on a fresh home: `finetune run`s started at once each start a temporary server; the
database is prepared once, under a lock (flows/orchestration/server_watch.py), and no run prints a traceback
(their concurrent first starts raced: the migration, then the block types' registration, an IntegrityError on
block_schema with a traceback)."""

from __future__ import annotations

import subprocess
import sys

import prefect
from helpers import ROOT, needs_shared_data, subprocess_env

pytestmark = needs_shared_data


def test_runs_started_at_once_on_a_fresh_prefect_home_migrate_once_and_print_no_traceback(tmp_path):
    home = tmp_path / "prefect"
    env = subprocess_env(tmp_path / "store", PREFECT_HOME=str(home))
    env.pop("PREFECT_API_URL", None)  # each starts a temporary server, as for a user without one
    args = [sys.executable, "-m", "flows.finetune", "tiny-imdb", "--until", "data",
            "--set", "data.subset={train: 16, validation: 4, test: 4}"]
    procs = [subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert "Traceback" not in out and "OperationalError" not in out, out[-3000:]
    assert (home / f".prepared-{prefect.__version__}").is_file()
