"""The store's guarantees on every backend: a local path, a file:// URL, fsspec's memory:// filesystem and
s3:// on a real S3 API (moto's server on 127.0.0.1): the shared-store path, uploads with the manifest last."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from helpers import computed, needs_shared_data, run, run_pipeline

from stages.engine.remote_store import RemoteStore, open_store
from stages.engine.runs import read_runs, records_root
from stages.engine.store import Store
from stages.pipeline.loading import load_pipeline

pytestmark = needs_shared_data
SMALL = ("data.subset={train: 40, validation: 8, test: 8}",)


@pytest.fixture(params=["path", "file", "memory", "s3"])
def store(request, tmp_path, monkeypatch) -> Store:
    if request.param == "s3":
        request.getfixturevalue("s3_endpoint")
    root = {"path": str(tmp_path / "store"), "file": f"file://{tmp_path}/store",
            "memory": f"memory://store-{uuid.uuid4().hex[:8]}",
            "s3": f"s3://finetune-test/store-{uuid.uuid4().hex[:8]}"}[request.param]
    monkeypatch.setenv("FINETUNE_STORE", root)
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    s = open_store()
    assert isinstance(s, RemoteStore) == (request.param in ("memory", "s3"))
    return s


def runs(*sets: str, **kw):
    return run("tiny-imdb", *SMALL, *sets, until="tokenize", **kw)


def test_rerun_is_cached_and_config_change_reruns_downstream(store):
    assert computed(runs()) == {"data", "tokenize"}
    assert computed(runs()) == set()
    assert computed(runs("tokenize.max_length=24")) == {"tokenize"}
    assert [e["event"] for e in store.events()] == ["computed", "computed", "cached", "cached", "cached",
                                                    "computed"]
    assert store.verify_all(full=True) == {}
    assert set(store.refs("tiny-imdb")) == {"data", "tokenize"}


def test_deleted_artifact_reruns_alone_and_forced_recompute_replaces(store):
    first = runs()
    store.remove("data", first["data"].key)
    assert store.problems("data", first["data"].key) == ["not in store"]
    again = runs()
    assert computed(again) == {"data"}
    assert again["data"].manifest["digest"] == first["data"].manifest["digest"]
    assert computed(runs(force=["tokenize"])) == {"tokenize"}
    assert store.verify_all(full=True) == {}


def test_only_on_a_fresh_cache_downloads_upstream(store, tmp_path, monkeypatch):
    first = runs()
    # another machine (empty local cache): --only tokenize --force tokenize reads data from the store
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "fresh-cache"))
    forced = runs(only="tokenize", force=["tokenize"])
    assert list(forced) == ["tokenize"] and computed(forced) == {"tokenize"}
    assert forced["tokenize"].key == first["tokenize"].key
    assert forced["tokenize"].manifest["digest"] == first["tokenize"].manifest["digest"]
    assert forced["tokenize"].manifest["upstream"]["data"]["digest"] == first["data"].manifest["digest"]


def test_upload_without_commit_marker_is_never_a_hit(tmp_path, monkeypatch, caplog):
    url = f"memory://store-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("FINETUNE_STORE", url)
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    store = open_store()
    first = runs()
    key = first["tokenize"].key
    # Simulate an upload killed before its manifest: drop the marker on the remote side.
    store.fs.rm_file(store._r("tokenize", key, "manifest.json"))
    assert store.problems("tokenize", key) == ["manifest.json missing"]
    # a fresh machine (empty local cache) sees a miss and recomputes
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache2"))
    assert computed(runs()) == {"tokenize"}
    assert open_store().verify_all(full=True) == {}
    # a truncated remote file is a miss too
    blob = store.fs.cat_file(store._r("data", first["data"].key, "test.arrow"))
    store.fs.pipe_file(store._r("data", first["data"].key, "test.arrow"), blob[:-5])
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache3"))
    with caplog.at_level("WARNING", logger="finetune.store"):
        assert computed(runs()) == {"data"}
    assert "data: artifact" in caplog.text and "is invalid (test.arrow: size" in caplog.text  # as locally


def test_second_machine_reuses_the_shared_store(tmp_path, monkeypatch):
    url = f"memory://store-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("FINETUNE_STORE", url)
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "machine-a"))
    assert computed(runs()) == {"data", "tokenize"}
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "machine-b"))
    again = runs()
    assert computed(again) == set()
    assert str(again["tokenize"].path).startswith(str(tmp_path / "machine-b"))  # its folder on b...
    assert not again["tokenize"].path.exists()  # ...where nothing is downloaded until something reads it
    folder = open_store().materialize("tokenize", again["tokenize"].key)  # a command asks for it: fetched
    assert folder == again["tokenize"].path and (folder / "dataset").is_dir()


def payload(cache: Path) -> list[Path]:
    """The artifact files in a machine's local cache (<hash>/<stage>/<key>/...)."""
    return [p for p in cache.glob("*/*/*/**/*") if p.is_file() and len(p.parts[len(cache.parts) + 2]) == 64
            and not p.parts[len(cache.parts) + 1].startswith(".")]


def test_on_s3_a_cached_run_on_a_fresh_worker_downloads_no_payload(s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_STORE", f"s3://finetune-test/lazy-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "a"))
    first = runs()
    store = open_store()
    manifests = sum(len(store.fs.cat_file(store._r(s, o.key, "manifest.json"))) for s, o in first.items())
    size = sum(f["size"] for o in first.values() for f in o.manifest["files"])
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "b"))  # another worker: an empty local cache
    fresh = open_store()
    outcomes = run_pipeline(load_pipeline("tiny-imdb", list(SMALL)), fresh, until="tokenize")
    assert [o.computed for o in outcomes] == [False, False]
    assert payload(tmp_path / "b") == []
    moved = read_runs(records_root(fresh))[-1]["transfers"]
    refs = len(store.fs.cat_file(store._r("refs", "tiny-imdb.json")))
    (record,) = store.fs.ls(store._r("results"), detail=False)  # the run's result (stages/engine/results.py)
    result = len(store.fs.cat_file(record))
    assert [(r["set"], sorted(r["keys"].items())) for _, r in fresh.results()] == [
        (list(SMALL), sorted((s, o.key) for s, o in first.items()))]
    # what it read: each stage's manifest once, the refs it checks and its result record once (a cached rerun
    # writes neither) and its own two leases (the gc lock's, its plan's) before deleting them: a few hundred bytes
    assert 0 <= moved["get_bytes"] - (manifests + len(first) * refs + result) < 1000, (moved, manifests, refs, result)
    assert moved["get_bytes"] < size / 10 and moved["put"] == 2 + len(first)  # leases of the run, events


def test_on_s3_a_compute_downloads_exactly_its_upstream_files(s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_STORE", f"s3://finetune-test/lazy-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "a"))
    first = runs()
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "b"))
    fresh = open_store()
    outcomes = {o.stage: o for o in run_pipeline(load_pipeline("tiny-imdb", list(SMALL)), fresh, until="tokenize",
                                                  force=["tokenize"])}
    assert not outcomes["data"].computed and outcomes["tokenize"].computed
    data = first["data"]
    got = sorted(str(p.relative_to(tmp_path / "b")) for p in payload(tmp_path / "b") if "/data/" in str(p))
    want = sorted(f"{fresh.root.name}/data/{data.key}/{f}" for f in [x["path"] for x in data.manifest["files"]]
                  + ["manifest.json"])
    assert got == want  # its upstream, whole; the forced stage's own old files never
    moved = read_runs(records_root(fresh))[-1]["transfers"]
    data_bytes = sum(f["size"] for f in data.manifest["files"])
    assert data_bytes <= moved["get_bytes"] < data_bytes + 64_000, (moved, data_bytes)
    assert moved["put_bytes"] >= sum(f["size"] for f in outcomes["tokenize"].manifest["files"])
