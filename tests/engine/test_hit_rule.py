"""One hit rule: for every state an artifact can be in, what `inspect status`, `finetune summary` and
`inspect diff` say about it is what `run` then does (reuse it or compute it), on a three-stage graph
a -> b -> c of plain file-writing bodies (no torch: each case costs milliseconds)."""

from __future__ import annotations

import json
import logging
import os

import pytest
from helpers import as_graph, plan, run_pipeline

from flows.reports.config_diff import diff
from flows.reports.run_summary import stage_rows
from stages.engine.stage import Stage
from stages.engine.status import CACHED, gc, lookups, pipeline_status
from stages.engine.store import Store
from stages.pipeline.loading import load_pipeline

NOISE = "HIT_RULE_NOISE"  # read by the bodies, in no key: a stage whose output is not a function of its key


def body_a(ctx) -> dict:
    (ctx.out_dir / "a.txt").write_text("a" + os.environ.get(NOISE, ""))
    return {}


def body_b(ctx) -> dict:
    (ctx.out_dir / "b.txt").write_text("b<" + (ctx.upstream["data"] / "a.txt").read_text())
    return {}


def body_c(ctx) -> dict:
    (ctx.out_dir / "c.txt").write_text("c<" + (ctx.upstream["tokenize"] / "b.txt").read_text())
    return {}


GRAPH = as_graph([Stage(name="data", body=body_a, reads=("data",)),
                  Stage(name="tokenize", body=body_b, reads=("tokenize",), upstream=("data",)),
                  Stage(name="model", body=body_c, reads=("model",), upstream=("tokenize",))])
A, B, C = GRAPH.names


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.delenv(NOISE, raising=False)
    cfg, store = load_pipeline("tiny-imdb", []), Store(tmp_path / "store")
    return cfg, store


def key(cfg, stage: str) -> str:
    return next(p.key.key for p in plan(cfg, None, GRAPH) if p.name == stage)


def file_of(store: Store, cfg, stage: str):
    return next(store.artifact_dir(stage, key(cfg, stage)).glob("*.txt"))


def predicted(cfg, store: Store, verify: bool = False) -> dict[str, str]:
    """What every report says of each stage: 'reuse', 'compute', or 'reuse if upstream reproduces'."""
    p = GRAPH.plan(cfg, store, verify=verify)
    statuses = {s.stage: s for s in pipeline_status(p, store)}
    summary = {r["stage"]: r["present"] for r in stage_rows(p, store)}
    shared = {s["stage"]: s["a_in_store"] for s in diff_in(cfg, store)} if not verify else summary  # no --verify
    out = {}
    for name in GRAPH.names:
        st = statuses[name]
        assert summary[name] == shared[name] == (st.status == CACHED), (name, st, summary, shared)
        out[name] = "compute" if st.status != CACHED else "reuse" if not st.reasons else "reuse if upstream"
    return out


def diff_in(cfg, store):
    from flows.reports import config_diff

    real = config_diff.GRAPH
    config_diff.GRAPH = GRAPH
    try:
        return diff(cfg, cfg, store)["stages"]
    finally:
        config_diff.GRAPH = real


def ran(cfg, store: Store, verify: bool = False) -> dict[str, str]:
    return {o.stage: "compute" if o.computed else "reuse" for o in run_pipeline(cfg, store, GRAPH, verify=verify)}


def test_empty_store_then_full_store(env):
    cfg, store = env
    assert predicted(cfg, store) == ran(cfg, store) == {A: "compute", B: "compute", C: "compute"}
    assert predicted(cfg, store) == ran(cfg, store) == {A: "reuse", B: "reuse", C: "reuse"}


@pytest.mark.parametrize("damage", ["deleted", "resized", "manifest lacks files[].size", "manifest not json",
                                    "manifest of another key"])
def test_a_damaged_artifact_is_recomputed_with_a_warning_and_downstream_reused_when_it_comes_out_the_same(
        env, damage, caplog):
    cfg, store = env
    ran(cfg, store)
    folder = store.artifact_dir(B, key(cfg, B))
    manifest = folder / "manifest.json"
    if damage == "deleted":
        (folder / "b.txt").unlink()
    elif damage == "resized":
        (folder / "b.txt").write_text("bb<a")
    elif damage == "manifest lacks files[].size":
        m = json.loads(manifest.read_text())
        del m["files"][0]["size"]
        manifest.write_text(json.dumps(m))
    elif damage == "manifest not json":
        manifest.write_text("{not json")
    else:
        m = json.loads(manifest.read_text())
        m["key"] = "f" * 64
        manifest.write_text(json.dumps(m))
    found = lookups(GRAPH.plan(cfg, store), store)[B]
    assert not found.hit and found.why != "not in store"
    # b recomputes; c is judged on its own files and reused when b comes out as it recorded (it does here)
    assert predicted(cfg, store) == {A: "reuse", B: "compute", C: "reuse if upstream"}
    with caplog.at_level(logging.WARNING, logger="finetune"):
        assert ran(cfg, store) == {A: "reuse", B: "compute", C: "reuse"}
    assert any("recomputing" in r.getMessage() for r in caplog.records)
    assert predicted(cfg, store) == {A: "reuse", B: "reuse", C: "reuse"}
    # a reachable artifact the rule rejects is listed by gc as invalid, never as a hit
    ran(cfg, store)
    (store.artifact_dir(B, key(cfg, B)) / "manifest.json").write_text("[]")
    listed = {(g.stage, g.key): g.note for g in gc(store, GRAPH, "pipeline.yaml")}
    assert "invalid" in listed[B, key(cfg, B)]


def test_changed_upstream_content_under_the_same_key(env, monkeypatch):
    """data recomputed (forced) with different output: tokenize's recorded upstream digest no longer matches.
    Every report calls tokenize stale, model conditional; the run recomputes both, under the same keys, and
    records what each replaced."""
    cfg, store = env
    ran(cfg, store)
    old_b = store.read_manifest(B, key(cfg, B))
    monkeypatch.setenv(NOISE, "!")
    run_pipeline(cfg, store, GRAPH, force=[A], until=A)
    status = {s.stage: s for s in pipeline_status(GRAPH.plan(cfg, store), store)}
    assert status[B].status == "stale" and "changed upstream content" in status[B].reasons[0]
    assert predicted(cfg, store) == {A: "reuse", B: "compute", C: "reuse if upstream"}
    assert ran(cfg, store) == {A: "reuse", B: "compute", C: "compute"}  # b's content changed, so c's input did
    new_b = store.read_manifest(B, key(cfg, B))
    assert new_b["replaces"] == old_b["digest"] != new_b["digest"] and "upstream data" in new_b["reason"]
    assert file_of(store, cfg, C).read_text() == "c<b<a!"
    replaced = [e for e in store.events() if e.get("replaces")]
    assert [(e["stage"], e["replaces"]) for e in replaced][0] == (B, old_b["digest"])
    assert predicted(cfg, store) == ran(cfg, store) == {A: "reuse", B: "reuse", C: "reuse"}


def test_a_same_size_flipped_byte_is_a_hit_by_sizes_and_a_miss_with_verify(env):
    cfg, store = env
    ran(cfg, store)
    file_of(store, cfg, B).write_text("b<A")  # same size
    assert predicted(cfg, store) == ran(cfg, store) == {A: "reuse", B: "reuse", C: "reuse"}
    assert predicted(cfg, store, verify=True) == {A: "reuse", B: "compute", C: "reuse if upstream"}
    assert ran(cfg, store, verify=True) == {A: "reuse", B: "compute", C: "reuse"}
    assert file_of(store, cfg, B).read_text() == "b<a"


def test_force_decides_before_any_lookup(env, monkeypatch):
    """A forced stage computes without the store being asked about its artifact (a shared store would
    fetch it); its manifest says it was forced."""
    cfg, store = env
    ran(cfg, store)
    asked: list[str] = []
    real = Store.lookup
    monkeypatch.setattr(Store, "lookup", lambda self, sk, *a, **k: asked.append(sk.stage) or real(self, sk, *a, **k))
    outcomes = {o.stage: o for o in run_pipeline(cfg, store, GRAPH, force=[B])}
    assert B not in asked and [o.computed for o in outcomes.values()] == [False, True, False]
    assert outcomes[B].manifest["reason"] == "forced"


class Recording:
    """An fsspec filesystem that records every path a read-side call touched."""

    READS = ("cat_file", "get_file", "open", "cat", "get", "size", "info", "exists", "isdir", "ls", "find")

    def __init__(self, fs):
        self._fs, self.read = fs, []

    def __getattr__(self, name):
        attr = getattr(self._fs, name)
        if name not in self.READS or not callable(attr):
            return attr
        return lambda path, *a, **k: self.read.append((name, str(path))) or attr(path, *a, **k)


def test_force_on_an_s3_store_fetches_nothing_of_the_forced_stage(env, s3_endpoint, tmp_path):
    """On a fresh machine (an empty local cache) `--force tokenize` reads none of the forced stage's files,
    manifest included, from S3: it downloads data (its input) and uploads the new tokenize; model is reused."""
    import uuid

    from stages.engine.remote_store import RemoteStore

    cfg, _ = env
    url = f"s3://finetune-test/force-{uuid.uuid4().hex[:8]}"
    ran(cfg, RemoteStore(url, cache=tmp_path / "machine-1"))
    fresh = RemoteStore(url, cache=tmp_path / "machine-2")
    fresh.fs = recording = Recording(fresh.fs)
    outcomes = {o.stage: o for o in run_pipeline(cfg, fresh, GRAPH, force=[B])}
    assert [o.computed for o in outcomes.values()] == [False, True, False]
    forced = f"/{B}/{key(cfg, B)}"
    downloads = [(m, p) for m, p in recording.read if m in ("cat_file", "get_file", "open", "cat", "get")]
    assert not [p for _, p in downloads if forced in p], downloads  # publish's exists() before replacing: no data
    assert any(f"/{A}/{key(cfg, A)}/a.txt" in p for m, p in downloads if m == "get_file")  # its input
    assert outcomes[B].manifest["reason"] == "forced"
    assert RemoteStore(url, cache=tmp_path / "machine-3").read_manifest(B, key(cfg, B))["reason"] == "forced"
