"""The shared store on a real S3 API (moto's server on 127.0.0.1, through s3fs): the lease lock holds
because the server enforces exclusive create, leases live while their holder does and expire after it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from helpers import needs_shared_data, subprocess_env

from stages.engine.remote_store import RemoteStore

ROOT = Path(__file__).resolve().parents[2]

# One "machine": its own local cache (so its own flocks); it speaks to the others only through S3.
MACHINE = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from stages.engine.remote_store import RemoteStore
    url, cache, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    store = RemoteStore(url, cache=cache)
    if mode == "race":  # trial i starts at t0 + i*step on both machines; a winner holds its lease to the end
        import contextlib
        print("ready", flush=True)
        t0, step, n = float(sys.stdin.readline()), float(sys.argv[4]), int(sys.argv[5])
        won = []
        with contextlib.ExitStack() as held_leases:
            for i in range(n):
                time.sleep(max(0.0, t0 + i * step - time.time()))
                won.append(held_leases.enter_context(store.try_lock(f"race-{i}")))
            print(json.dumps(won), flush=True)
            sys.stdin.readline()  # released once both machines are done: a late one must find them held
    else:  # hold one key for sys.argv[4] seconds
        with store.try_lock("long") as held:
            print("held" if held else "refused", flush=True)
            time.sleep(float(sys.argv[4]))
        print("released", flush=True)
""")


def machine(s3_store_url: str, cache: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", MACHINE, s3_store_url, str(cache), *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True)


@pytest.fixture
def url(s3_endpoint) -> str:
    return f"s3://finetune-test/store-{uuid.uuid4().hex[:8]}"


def test_two_machines_racing_for_one_key_exactly_one_wins(url, tmp_path):
    n, step = 50, 0.2
    procs = [machine(url, tmp_path / name, "race", str(step), str(n)) for name in ("a", "b")]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    t0 = time.time() + 1
    for p in procs:  # both imported and waiting: each trial is two creates of one key at the same instant
        p.stdin.write(f"{t0}\n")
        p.stdin.flush()
    a, b = (json.loads(p.stdout.readline()) for p in procs)
    for p in procs:
        p.communicate("done\n", timeout=120)
    assert [x + y for x, y in zip(a, b, strict=True)] == [1] * n  # every trial: one winner, one refused


def test_dead_holders_lease_expires_a_live_holders_never(url, tmp_path):
    ttl = {"FINETUNE_LEASE_TTL_S": "3"}
    other = RemoteStore(url, cache=tmp_path / "other")
    dead = machine(url, tmp_path / "dead", "hold", "600", env=ttl)
    assert dead.stdout.readline().strip() == "held"
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait()
    with other.try_lock("long") as held:
        assert not held  # killed just now: its lease has not expired yet
    time.sleep(4)
    with other.try_lock("long") as held:
        assert held  # not renewed for its TTL: taken over
    # a live holder renews its lease (every TTL/4): it is never taken over however long it runs
    live = machine(url, tmp_path / "live", "hold", "9", env=ttl)
    assert live.stdout.readline().strip() == "held"
    deadline = time.time() + 7
    while time.time() < deadline:
        with other.try_lock("long") as held:
            assert not held
        time.sleep(0.5)
    assert live.stdout.readline().strip() == "released"
    live.wait(30)
    with other.try_lock("long") as held:
        assert held


def test_a_crashed_runs_newest_checkpoint_resumes_on_another_machine(url, tmp_path):
    from stages.engine.store import StageKey, work_saved

    sk = StageKey("train", {"lr": 1}, {}, {}, "code", (), {})

    def crashing(out: Path, work: Path) -> None:  # saves step-1, then step-2 (replacing it there), dies
        for step in (1, 2):
            ck = work / "checkpoints" / f"step-{step}"
            ck.mkdir(parents=True)
            (ck / "weights").write_text(f"w{step}")
            (ck / "progress.json").write_text(json.dumps({"step": step}))
            work_saved(ck)
        (work / "logs").mkdir()
        raise RuntimeError("machine a died")

    a = RemoteStore(url, cache=tmp_path / "a")
    with pytest.raises(RuntimeError):
        a.run(sk, crashing, pipeline="p", config={})
    remote = sorted(p.rsplit(f"train-{sk.key}/", 1)[1] for p in a.fs.find(a._r(".work", f"train-{sk.key}")))
    assert remote == ["checkpoints/step-2/progress.json", "checkpoints/step-2/weights", "latest.json"]

    seen = {}

    def resuming(out: Path, work: Path) -> dict:
        seen["found"] = sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file())
        (out / "weights").write_text("final")
        return {}

    b = RemoteStore(url, cache=tmp_path / "b")  # another machine: an empty local cache
    assert b.run(sk, resuming, pipeline="p", config={}).computed
    assert seen["found"] == ["checkpoints/step-2/progress.json", "checkpoints/step-2/weights"]
    assert not b.fs.exists(b._r(".work", f"train-{sk.key}"))  # committed: the shared work is dropped


S3_RUN = ("tiny-imdb", "--set", "data.subset={train: 32, validation: 8, test: 8}", "--set", "train.log_every=1")


@needs_shared_data
def test_a_missing_bucket_is_one_line_before_prefect_starts(s3_endpoint, tmp_path):
    env = subprocess_env("s3://no-such-bucket/store", FINETUNE_CACHE=str(tmp_path / "cache"))
    env.pop("PREFECT_API_URL", None)
    r = subprocess.run([sys.executable, "-m", "flows.finetune", *S3_RUN], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.endswith(
        "error: the store s3://no-such-bucket/store cannot be written: its bucket does not exist; stage data must "
        "be computed (not in store) and cannot be committed there. Make it writable (or create its bucket), or set "
        "FINETUNE_STORE to a store you can write (a store that cannot be written serves fully cached runs only)\n")
    assert "Traceback" not in r.stderr and "temporary server" not in r.stderr  # before Prefect started


@needs_shared_data
def test_an_s3_server_that_dies_mid_run_is_one_line(tmp_path):
    """The S3 server killed while train runs: the stage stops (its lease cannot be renewed), nothing of it is
    committed, and the run ends with one line naming the store and the stage, exit 2, no traceback (before:
    seven, from the stage, the lease heartbeat and the run's registration)."""
    from s3server import moto_server, s3_env

    log = tmp_path / "out.log"
    with moto_server() as endpoint:
        env = subprocess_env("s3://finetune-test/store", FINETUNE_CACHE=str(tmp_path / "cache"), **s3_env(endpoint))
        subprocess.run([sys.executable, "-c", "import s3fs; s3fs.S3FileSystem().mkdir('finetune-test')"], env=env,
                       check=True, timeout=60)
        with log.open("w") as fh:
            p = subprocess.Popen([sys.executable, "-m", "stages", *S3_RUN, "--set", "train.epochs=50"], cwd=ROOT,
                                 env=env, stdout=fh, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            while "Step 0002/" not in log.read_text():
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
        except BaseException:
            p.kill()
            raise
    try:  # the server is gone
        code = p.wait(timeout=120)
    finally:
        p.kill()
    out = log.read_text()
    assert code == 2 and "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(
        r"error: stage train: the store s3://finetune-test/store stopped answering: its endpoint does not answer "
        r"\(EndpointConnectionError: .*\); nothing of train was committed and the stages before it stay in the "
        r"store: rerun once it answers, which reuses them", errors[0]), out[-3000:]


@needs_shared_data
def test_an_s3_endpoint_that_does_not_answer_is_one_line_before_prefect_starts(tmp_path):
    from s3server import free_port, s3_env

    env = subprocess_env("s3://finetune-test/store", FINETUNE_CACHE=str(tmp_path / "cache"),
                         **s3_env(f"http://127.0.0.1:{free_port()}"))  # nothing listens there
    env.pop("PREFECT_API_URL", None)
    r = subprocess.run([sys.executable, "-m", "flows.finetune", *S3_RUN], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert re.fullmatch(r"error: the store s3://finetune-test/store cannot be reached: its endpoint does not answer "
                        r"\(EndpointConnectionError: .*\); check its endpoint \(AWS_ENDPOINT_URL\) and the network, "
                        r"or set FINETUNE_STORE to another store", r.stderr.splitlines()[-1]), r.stderr
    assert "Traceback" not in r.stderr and "temporary server" not in r.stderr
