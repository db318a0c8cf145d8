"""A run that lost its key's lease never writes again. Run A is stopped (SIGSTOP) in a training-like stage past
the lease's TTL; run B, on another machine, takes the lease over, resumes from A's checkpoint and commits. A,
continued, stops at once on one line, and B's artifact keeps every object as B wrote it. On the local store a
stopped run keeps its key (its flock), so there is no late writer: B waits and reuses what A commits."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stages.engine.errors import LeaseLostError
from stages.engine.remote_store import RemoteStore
from stages.engine.store import StageKey, work_saved

ROOT = Path(__file__).resolve().parents[2]
TTL = "2"
SK = StageKey("train", {"lr": 1}, {}, {}, "code", (), {})

# One machine's run of one key: a stage that saves a checkpoint per step (resuming from the newest one it
# finds), then writes random weights, so two runs' artifacts never have the same bytes.
MACHINE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from stages.engine.cli import user_errors
    from stages.engine.remote_store import open_store, RemoteStore
    from stages.engine.store import StageKey, work_saved
    url, cache, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    store = RemoteStore(url, cache=cache) if url.startswith("s3://") else open_store(url)
    sk = StageKey("train", {"lr": 1}, {}, {}, "code", (), {})

    def train(out, work):
        done = [int(p.name.split("-")[1]) for p in (work / "checkpoints").glob("step-*")]
        print("from", max(done, default=0), flush=True)
        for step in range(max(done, default=0) + 1, steps + 1):
            ck = work / "checkpoints" / f"step-{step}"
            ck.mkdir(parents=True)
            (ck / "weights").write_bytes(os.urandom(64))
            work_saved(ck)
            print("step", step, flush=True)
            time.sleep(0.2)
        (out / "weights").write_bytes(os.urandom(4096))
        return {}

    with user_errors() as failed:
        outcome = store.run(sk, train, pipeline="p", config={})
        print("computed" if outcome.computed else "cached", outcome.manifest["digest"], flush=True)
        sys.exit(0)
    sys.exit(failed.code)
""")


def machine(url: str, cache: Path, steps: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FINETUNE_LEASE_TTL_S": TTL}
    return subprocess.Popen([sys.executable, "-c", MACHINE, url, str(cache), str(steps)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(proc: subprocess.Popen, line: str) -> None:
    assert proc.stdout is not None
    while (got := proc.stdout.readline()) and got.strip() != line:
        pass
    assert got.strip() == line, f"the run ended before printing {line!r}: {proc.wait()} {proc.stderr.read()}"


def objects(store: RemoteStore) -> dict[str, tuple[str, Any]]:
    """Every object of the shared store with its ETag and time: what a write would change."""
    store.fs.invalidate_cache()
    return {p: (i.get("ETag"), i.get("LastModified")) for p, i in store.fs.find(store.base, detail=True).items()}


@pytest.fixture
def url(s3_endpoint) -> str:
    return f"s3://finetune-test/fence-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def threaded_url(monkeypatch) -> Iterator[str]:
    """A store on a moto server of its own that serves requests in threads: run A may be stopped in the middle of
    a request (its heartbeat's), and the session's single-threaded server would then wait on it, serving no B."""
    import s3fs
    from s3server import moto_server, s3_env

    with moto_server(threaded=True) as endpoint:
        for k, v in s3_env(endpoint).items():
            monkeypatch.setenv(k, v)
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir("finetune-test")
        try:
            yield f"s3://finetune-test/fence-{uuid.uuid4().hex[:8]}"
        finally:
            s3fs.S3FileSystem.clear_instance_cache()


def test_a_run_stopped_past_its_lease_stops_on_one_line_and_the_new_holders_artifact_is_untouched(threaded_url,
                                                                                                   tmp_path):
    url = threaded_url
    a = machine(url, tmp_path / "a", 60)  # 12 s of steps: it is stopped after its second
    wait_for(a, "step 2")
    os.kill(a.pid, signal.SIGSTOP)
    try:
        b = machine(url, tmp_path / "b", 4)  # waits for A's lease to run out, takes it over, resumes at A's step 2
        out, err = b.communicate(timeout=60)
        assert b.returncode == 0, err
        assert out.splitlines()[0] == "from 2" and out.splitlines()[-1].startswith("computed ")
        assert "taking it over" in err
        store = RemoteStore(url, cache=tmp_path / "check")
        before = objects(store)
        artifact = {p for p in before if f"/train/{SK.key}/" in p}
        assert {p.rsplit("/", 1)[1] for p in artifact} == {"weights", "manifest.json"}
        assert not any("/.work/" in p for p in before)  # B committed: the checkpoints are dropped
    finally:
        os.kill(a.pid, signal.SIGCONT)
    t0 = time.monotonic()
    a_out, a_err = a.communicate(timeout=60)
    stopped_after = time.monotonic() - t0
    assert a.returncode == 2
    assert stopped_after < 5, stopped_after  # at once, with 58 steps (11.6 s) left
    assert "computed" not in a_out
    [line] = a_err.strip().splitlines()  # one line, no traceback
    assert line.startswith(f"error: train: another run (host {socket.gethostname()} pid {b.pid}) took over the "
                           f"lease on key {SK.key[:12]}"), line
    assert "rerun to reuse its artifact" in line
    assert objects(store) == before  # A wrote nothing: B's artifact keeps its ETags and times, no .work again
    found = store.lookup(SK, {})
    assert found.hit and found.manifest is not None
    assert found.manifest["digest"] == out.split()[-1]  # B's commit


@pytest.mark.parametrize("late", ["checkpoint", "commit"])
def test_a_late_write_the_heartbeat_has_not_caught_is_refused_by_the_fence(url, tmp_path, monkeypatch, late):
    """The fence alone: A's heartbeat is stopped (as in a stopped process), so nothing stops A's body; B takes
    the key over and commits; then A's next write, a checkpoint or its commit, is refused and writes nothing."""
    monkeypatch.setenv("FINETUNE_LEASE_TTL_S", "1")
    a, b = RemoteStore(url, cache=tmp_path / "a"), RemoteStore(url, cache=tmp_path / "b")
    seen: dict[str, Any] = {}

    def b_body(out: Path, work: Path) -> dict:
        (out / "weights").write_bytes(os.urandom(4096))
        return {}

    def a_body(out: Path, work: Path) -> dict:
        lease = a._leases[SK.key]
        lease._stop.set()  # its heartbeat stalls: the lease is not renewed, and its loss goes unnoticed
        lease._beat.join()
        time.sleep(1.3)
        seen["b"] = b.run(SK, b_body, pipeline="p", config={})  # another machine: takes the key over, commits
        seen["objects"] = objects(b)
        ck = work / "checkpoints" / "step-1"
        ck.mkdir(parents=True)
        (ck / "weights").write_bytes(b"a")
        if late == "checkpoint":
            work_saved(ck)
        (out / "weights").write_bytes(os.urandom(4096))
        return {}

    with pytest.raises(LeaseLostError, match=f"another run \\(host .* pid {os.getpid()}\\) took over the lease on "
                                             f"key {SK.key[:12]}"):
        a.run(SK, a_body, pipeline="p", config={})
    assert seen["b"].computed
    assert objects(b) == seen["objects"]
    assert not a.artifact_dir("train", SK.key).exists()  # not published: no local copy claims to be it
    found = b.lookup(SK, {})
    assert found.hit and found.manifest is not None and found.manifest["digest"] == seen["b"].manifest["digest"]


def test_on_the_local_store_a_stopped_run_keeps_its_key_and_the_next_run_reuses_its_commit(tmp_path):
    store = tmp_path / "store"
    a = machine(str(store), tmp_path / "unused", 12)
    wait_for(a, "step 2")
    os.kill(a.pid, signal.SIGSTOP)
    try:
        b = machine(str(store), tmp_path / "unused", 4)
        time.sleep(float(TTL) * 2)
        assert b.poll() is None  # waiting on the key's flock, which the stopped process still holds
        assert not (store / "train" / SK.key).exists()
    finally:
        os.kill(a.pid, signal.SIGCONT)
    a_out, a_err = a.communicate(timeout=60)
    assert a.returncode == 0, a_err
    committed = store / "train" / SK.key / "weights"
    stat = committed.stat()
    b_out, b_err = b.communicate(timeout=60)
    assert b.returncode == 0, b_err
    assert b_out.split() == ["cached", a_out.split()[-1]]  # B computed nothing: A's artifact, A's digest
    assert (committed.stat().st_ino, committed.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
