"""A method that adds a stage: the graph is per pipeline (the core stages plus the method's), the added stage
runs through the store like any other, and a pipeline of another method neither runs it nor has a key that
depends on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import IMDB, needs_shared_data, plan, run_pipeline

from stages.engine.errors import ConfigError
from stages.engine.store import Store
from stages.graph import graph_for
from stages.pipeline.loading import load_pipeline

METHOD = '''
import json

from stages.engine.stage import Stage
from stages.methods.classify import Classify


def lengths(ctx):
    """The mean character length of each split's texts, from the data stage's Arrow files."""
    import pyarrow.ipc as ipc

    out = {}
    for f in sorted(ctx.upstream["data"].glob("*.arrow")):
        texts = ipc.open_file(str(f)).read_all().column("text").to_pylist()
        out[f.stem] = sum(map(len, texts)) / len(texts)
    (ctx.out_dir / "lengths.json").write_text(json.dumps(out))
    return {"splits": len(out)}


class WithLengths(Classify):
    name = "classify_with_lengths"

    def stages(self):
        return [Stage(name="lengths", body=lengths, reads=("data",), upstream=("data",))]

    def upstream(self):
        return {"train": ("lengths",)}
'''


@pytest.fixture
def method(tmp_path: Path) -> str:
    (tmp_path / "with_lengths.py").write_text(METHOD)
    return f"method={tmp_path / 'with_lengths.py'}:WithLengths"


def test_the_graph_of_a_pipeline_holds_its_methods_stages(method: str):
    plain = load_pipeline("tiny-imdb", list(IMDB))
    before = {p.stage.name: p.key.key for p in plan(plain)}  # before the method with a stage is ever loaded
    cfg = load_pipeline("tiny-imdb", [method, *IMDB])
    graph = graph_for(cfg)
    assert graph.names == ["data", "lengths", "tokenize", "model", "adapters", "train", "evaluate", "export"]
    assert "lengths" in graph["train"].upstream
    assert "lengths" not in graph_for(plain).names
    assert {p.stage.name: p.key.key for p in plan(load_pipeline("tiny-imdb", [method, *IMDB]))}["train"] != \
        before["train"]  # its train reads the added stage
    assert {p.stage.name: p.key.key for p in plan(plain)} == before  # the other pipeline's keys: as they were


@needs_shared_data
def test_the_added_stage_runs_through_the_store_and_only_where_its_method_runs(method: str, tmp_path: Path):
    store = Store(tmp_path / "store")
    cfg = load_pipeline("tiny-imdb", [method, *IMDB])
    out = {o.stage: o for o in run_pipeline(cfg, store, until="lengths")}
    assert list(out) == ["data", "lengths"] and out["lengths"].computed
    assert out["lengths"].manifest["metrics"] == {"splits": 3}
    assert not any(o.computed for o in run_pipeline(cfg, store, until="lengths"))  # cached
    forced = {o.stage: o for o in run_pipeline(cfg, store, only="lengths", force=["lengths"])}
    assert forced["lengths"].computed
    with pytest.raises(ConfigError, match="--only lengths: unknown stage; stages are data, tokenize, model"):
        run_pipeline(load_pipeline("tiny-imdb", list(IMDB)), store, only="lengths")
