"""gc never takes a live run's work: gc --force in a loop beside a running --set variant (whose keys no
pipeline of the file reaches) removes none of what the run reads or commits, and the run finishes; a dead
run's registration protects nothing; on a shared store the registration is a lease that runs out."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import helpers
import pytest
from helpers import needs_shared_data, spawn

from stages.engine.remote_store import open_store
from stages.engine.status import gc
from stages.engine.store import StageKey, Store
from stages.graph import GRAPH

ROOT = Path(__file__).resolve().parents[2]
VARIANT = ["tiny-imdb", "--set", "train.lr=3e-3", "--set", "data.subset={train: 64, validation: 16, test: 16}"]


@needs_shared_data
def test_gc_in_a_loop_beside_a_running_variant_takes_nothing_it_reads_or_commits(tmp_path):
    store = Store(tmp_path / "store")
    proc = spawn(VARIANT, store.root)
    live = store.root / ".state" / "live"
    during, after, sweeps = [], [], 0
    while proc.poll() is None or not sweeps:
        if store.exists():
            took = [(g.stage, g.key) for g in gc(store, GRAPH, force=True, keep_refs=False) if g.removed]
            if any(live.glob("*.json")):  # registered all through that sweep (a run registers once)
                during += took
                sweeps += 1
            elif sweeps:
                after += took  # the run ended during this sweep: its variant is fair game now
                break
        time.sleep(0.2)
    out = proc.communicate()[0]
    assert proc.returncode == 0, out[-3000:]  # evaluate and export read what train committed
    assert re.findall(r"^  (\w+) +computed", out, re.M) == [s.name for s in GRAPH], out[-3000:]
    assert sweeps >= 3 and during == [], (sweeps, during)  # a sweep plans every pipeline: seconds under load
    assert list(live.glob("*.json")) == []  # the run dropped its registration
    # the run is over: what of its variant no pipeline reaches (model and adapters tiny-imdb's own) is taken
    after += [(g.stage, g.key) for g in gc(store, GRAPH, force=True, keep_refs=False) if g.removed]
    assert {stage for stage, _ in after} == {"data", "tokenize", "train", "evaluate", "export"}


def test_a_live_registration_protects_its_keys_and_a_dead_ones_does_not(tmp_path):
    store = Store(tmp_path / "store")
    keys = [("train", "a" * 64), ("export", "b" * 64)]
    with store.protecting(keys):
        assert store.live_keys() == set(keys)
    assert store.live_keys() == set()
    dead = store.root / ".state" / "live" / "999999-deadbeef.json"  # a kill -9: its file stays, unlocked
    dead.write_text('{"keys": [["train", "' + "c" * 64 + '"]]}')
    assert store.live_keys() == set() and not dead.exists()


@pytest.mark.parametrize("ttl", ["2"])
def test_on_a_shared_store_a_live_run_is_a_lease_that_runs_out(tmp_path, monkeypatch, ttl):
    monkeypatch.setenv("FINETUNE_LEASE_TTL_S", ttl)
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    store = open_store(f"memory://gc-live-{uuid.uuid4().hex[:8]}")
    keys = [("train", "a" * 64)]
    with store.protecting(keys):
        time.sleep(2.5)  # past one TTL: the heartbeat (every TTL/4) kept it alive
        assert store.live_keys() == set(keys)
    assert store.live_keys() == set()
    lease = store.fs.ls(store._r(".live"), detail=False) if store.fs.exists(store._r(".live")) else []
    assert lease == []


@needs_shared_data
def test_an_artifact_younger_than_min_age_is_listed_and_kept(store_dir):
    helpers.run("tiny-imdb", "data.subset={train: 8, validation: 4, test: 4}", until="data")  # a variant: unreachable
    store = Store(store_dir)
    young = gc(store, GRAPH, force=True, min_age_s=600, keep_refs=False)
    assert [(g.stage, g.young, g.removed, g.note) for g in young] == [
        ("data", True, False, "newer than 10 min; kept (--min-age)")]
    assert [(g.stage, g.removed) for g in gc(store, GRAPH, force=True, keep_refs=False)] == [("data", True)]


# A machine computing a train key: it publishes a checkpoint to the shared store's .work/, then holds the key
# (its lease renewed by the heartbeat) until it is killed.
HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from stages.engine.remote_store import RemoteStore
    from stages.engine.store import StageKey, work_saved
    store = RemoteStore(sys.argv[1], cache=Path(sys.argv[2]))
    def body(out, work):
        ck = work / "checkpoints" / "step-1"
        ck.mkdir(parents=True)
        (ck / "weights").write_bytes(b"w" * 5000)
        (ck / "progress.json").write_text('{"step": 1}')
        work_saved(ck)
        print("saved", flush=True)
        time.sleep(600)
    store.run(StageKey("train", {"lr": sys.argv[3]}, {}, {}, "code", (), {}), body, pipeline="p", config={})
""")


@needs_shared_data
def test_gc_on_a_shared_store_takes_a_dead_runs_work_and_never_a_live_ones(s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_LEASE_TTL_S", "2")
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "gc-machine"))
    url = f"s3://finetune-test/gc-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holders = {who: subprocess.Popen([sys.executable, "-c", HOLDER, url, str(tmp_path / who), who], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, text=True) for who in ("dead", "live")}
    try:
        for p in holders.values():
            assert p.stdout.readline().strip() == "saved"
        os.kill(holders["dead"].pid, signal.SIGKILL)
        holders["dead"].wait()
        time.sleep(3)  # past the dead holder's TTL: its lease has expired; the live one's is renewed
        store = open_store(url)
        key = {who: StageKey("train", {"lr": who}, {}, {}, "code", (), {}).key for who in holders}
        listed = [(g.kind, g.key, g.path, g.size_bytes) for g in gc(store, GRAPH, keep_refs=False)
                  if g.kind == "work"]
        assert listed == [("work", key["dead"], f"{url}/.work/train-{key['dead']}", 5000 + 11 + len(
            store.fs.cat_file(store._r(".work", f"train-{key['dead']}", "latest.json"))))]
        removed = [(g.key, g.removed) for g in gc(store, GRAPH, force=True, keep_refs=False) if g.kind == "work"]
        assert removed == [(key["dead"], True)]
        assert not store.fs.exists(store._r(".work", f"train-{key['dead']}"))
        store.fs.invalidate_cache()
        live = store.fs.find(store._r(".work", f"train-{key['live']}"))
        assert sorted(p.rsplit("/", 1)[-1] for p in live) == ["latest.json", "progress.json", "weights"]
        assert holders["live"].poll() is None  # still computing, its work untouched
    finally:
        for p in holders.values():
            if p.poll() is None:
                p.kill()
                p.wait()
