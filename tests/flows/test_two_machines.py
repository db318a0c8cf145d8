"""Two machines, simulated on one: a real Prefect server, a `process` work pool, two workers (each its own
local cache and work folder) and one shared s3:// store (moto's S3 server). A sweep dispatched to the pool
spreads its variants over both workers, and the stages they share are computed once across them.
docs/two-machines.md is this test's walkthrough, command by command. Every server and worker is started
and stopped by its PID (process group): tests/cluster.py."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from cluster import PREFECT, ROOT, base_env, machines, orchestrator, run
from helpers import needs_shared_data
from helpers import run as helpers_run

from stages.engine.remote_store import RemoteStore

pytestmark = [needs_shared_data, pytest.mark.cluster]
SMALL = "data.subset={train: 40, validation: 8, test: 8}"


@pytest.fixture(scope="module")
def cluster(s3_endpoint, prefect_server, tmp_path_factory) -> Iterator[tuple[dict[str, str], Path]]:
    """The orchestrating machine: a Prefect server (this test process's, tests/conftest.py), the `process`
    pool, finetune/tiny-imdb deployed to it. Yields the environment every machine shares (PREFECT_API_URL,
    FINETUNE_STORE) and a folder."""
    tmp = tmp_path_factory.mktemp("cluster")
    store = f"s3://finetune-test/two-machines-{uuid.uuid4().hex[:8]}"
    with orchestrator(base_env(tmp, store), tmp, ["tiny-imdb"], api=prefect_server) as env:
        yield env, tmp


def test_a_sweep_on_a_work_pool_spreads_over_two_workers_sharing_one_s3_store(cluster):
    env, tmp = cluster
    tmp = tmp / "sweep"
    with machines(env, tmp, "a", "b"):
        out = run([sys.executable, "-m", "flows.sweep", "tiny-imdb", "--grid", "train.lr=1e-3,5e-4",
                   "--set", SMALL, "--parallel", "2", "--on-workers"],
                  {**env, "FINETUNE_CACHE": str(tmp / "orchestrator")}, ROOT, timeout=300)
    assert f"store: {env['FINETUNE_STORE']}" in out
    # each worker trained one variant: its local cache holds one train artifact
    trained = {n: list((tmp / n / "cache").glob("*/train/*/manifest.json")) for n in ("a", "b")}
    assert {n: len(v) for n, v in trained.items()} == {"a": 1, "b": 1}, out
    # the shared store saw every stage computed once per key: the variants' common stages once in all
    events = RemoteStore(env["FINETUNE_STORE"], cache=tmp / "reader").events()
    computed = Counter((e["stage"], e["key"]) for e in events if e["event"] == "computed")
    assert set(computed.values()) == {1}
    per_stage = Counter(stage for stage, _ in computed)
    assert per_stage["train"] == 2 and per_stage["data"] == per_stage["tokenize"] == per_stage["model"] == 1
    cached = {e["stage"] for e in events if e["event"] == "cached"}
    assert {"data", "tokenize", "model"} <= cached  # the second worker took them from the store


FLOW_RUN = """
import sys
from prefect.client.orchestration import get_client
from prefect.states import Crashed
with get_client(sync_client=True) as c:  # what the operator (or an automation) says of a run whose machine died
    c.set_flow_run_state(sys.argv[2], Crashed(message="its machine was killed"), force=True)
"""


def flow_run_state(env: dict[str, str], run_id: str) -> str:
    """The flow run's state type, read from the API (polled: a request, not a process per look)."""
    try:
        r = httpx.get(f"{env['PREFECT_API_URL']}/flow_runs/{run_id}", timeout=10)
        return r.json()["state"]["type"]
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return "UNKNOWN"
RESUME = [SMALL.replace("40", "160"), "train.max_steps=40", "train.checkpoint_every=2",
          "evaluate.splits=[test]"]


def test_a_run_killed_with_its_machine_resumes_on_the_other_from_the_shared_checkpoint(cluster, tmp_path,
                                                                                         monkeypatch):
    import torch
    from safetensors.torch import load_file

    env, tmp = cluster
    tmp = tmp / "resume"
    params = json.dumps({"overrides": RESUME})
    with machines(env, tmp, "a", "b", FINETUNE_LEASE_TTL_S="6") as workers:
        out = run([PREFECT, "deployment", "run", "finetune/tiny-imdb", "--params", params], env, ROOT)
        run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
        shared = RemoteStore(env["FINETUNE_STORE"], cache=tmp / "reader")
        deadline = time.monotonic() + 240
        while True:  # wait for a checkpoint past step 2 on the shared store, then kill its machine
            latest = [p for p in shared.fs.glob(shared._r(".work", "train-*", "latest.json"))]
            step = json.loads(shared.fs.cat_file(latest[0]))["folder"] if latest else ""
            if step >= "checkpoints/step-000004":
                break
            assert time.monotonic() < deadline, "no checkpoint reached the shared store"
            time.sleep(0.3)
            shared.fs.invalidate_cache()
        victim = next(n for n in workers if list((tmp / n / "cache").glob("*/.work/train-*")))
        survivor = ({"a", "b"} - {victim}).pop()
        tree = psutil.Process(workers[victim].pid)
        for p in [*tree.children(recursive=True), tree]:  # the worker and the flow run it started: kill -9
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        workers[victim].wait()
        run([sys.executable, "-c", FLOW_RUN, "crashed", run_id], env, ROOT)
        run([PREFECT, "flow-run", "retry", run_id], env, ROOT)
        while (state := flow_run_state(env, run_id)) not in ("COMPLETED", "FAILED", "CRASHED"):
            assert time.monotonic() < deadline + 240, state
            time.sleep(2)
    log = (tmp / survivor / "worker.log").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert "train: resuming from checkpoints/step-" in log and "train: resumed from step " in log, log[-3000:]
    resumed = int(re.search(r"train: resumed from step (\d+)", log).group(1))
    assert resumed >= 4
    # the uninterrupted run, here, in a local store: the resumed weights equal it
    monkeypatch.setenv("FINETUNE_STORE", str(tmp_path / "reference"))
    torch.set_num_threads(1)
    ref = helpers_run("tiny-imdb", *RESUME, until="train")["train"]
    got = list((tmp / survivor / "cache").glob(f"*/train/{ref.key}"))
    assert len(got) == 1
    diffs = {}
    for f in sorted((ref.path / "trained").glob("*.safetensors")):
        a, b = load_file(str(f)), load_file(str(got[0] / "trained" / f.name))
        diffs[f.name] = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"resumed from step {resumed} on {survivor}: max |w - w_uninterrupted| = {diffs}")
    assert diffs and max(diffs.values()) <= 1e-6
