"""A hub model is keyed by the commit its revision points at, not by the revision's name: offline, from a
fake Hugging Face cache holding two snapshots of a tiny model and a `refs/main` that moves."""

from __future__ import annotations

import huggingface_hub.constants
import pytest
import torch
import transformers
from helpers import IMDB, needs_shared_data, plan, run_pipeline

from stages.engine.fingerprint import UNRESOLVED
from stages.engine.status import why_changed
from stages.engine.store import Store
from stages.models.model_loading import load_model
from stages.pipeline.loading import load_pipeline
from stages.sources.hub import revision_sha

REPO = "acme/tiny-bloom"
SHA_A, SHA_B = "a1b2c3d" + "0" * 33, "e4f5a6b" + "1" * 33
SETS = [*IMDB, f"model.name={REPO}", "model.from_config=null"]


def snapshot(cache, sha: str, seed: int) -> None:
    """A tiny BLOOM classifier saved as the repo's snapshot `sha`, and refs/main pointing at it."""
    torch.manual_seed(seed)
    config = transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=30522, num_labels=2,
                                      pad_token_id=0)
    repo = cache / f"models--{REPO.replace('/', '--')}"
    transformers.BloomForSequenceClassification(config).save_pretrained(repo / "snapshots" / sha)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(sha)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf-hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def model_item(cfg, store):
    return next(p for p in plan(cfg, store) if p.stage.name == "model")


def test_revision_resolves_from_the_cache_refs(hub_cache):
    assert revision_sha(REPO, "main") == UNRESOLVED  # nothing cached, hub off: no identity to pin
    snapshot(hub_cache, SHA_A, 0)
    assert revision_sha(REPO, "main") == SHA_A
    assert revision_sha(REPO, None) == SHA_A  # no revision means main
    assert revision_sha(REPO, SHA_B) == SHA_B  # a commit sha is its own identity


@needs_shared_data
def test_a_moved_revision_makes_the_model_stale_and_the_rerun_loads_the_new_commit(hub_cache, tmp_path):
    store = Store(tmp_path / "store")
    snapshot(hub_cache, SHA_A, seed=0)
    cfg = load_pipeline("tiny-imdb", SETS)
    first = {o.stage: o for o in run_pipeline(cfg, store, until="model")}
    assert first["model"].computed
    assert first["model"].manifest["key_inputs"]["inputs"][f"hub {REPO}@main"] == SHA_A  # the manifest names it
    assert model_item(cfg, store).key.key == first["model"].key  # unchanged refs: a hit

    snapshot(hub_cache, SHA_B, seed=1)  # the repo moved on: main -> B
    item = model_item(cfg, store)
    assert item.key.key != first["model"].key
    assert why_changed(first["model"].manifest["key_inputs"], item.key) == \
        [f"changed deps: hub {REPO}@main a1b2c3d -> e4f5a6b"]
    tokenize = next(p for p in plan(cfg, store) if p.stage.name == "tokenize")
    assert tokenize.key.key == first["tokenize"].key  # its tokenizer is local: not affected

    second = {o.stage: o for o in run_pipeline(cfg, store, until="model")}
    assert second["model"].computed and not second["tokenize"].computed
    repo = hub_cache / f"models--{REPO.replace('/', '--')}" / "snapshots"
    for outcome, sha in ((first["model"], SHA_A), (second["model"], SHA_B)):  # each artifact holds its commit
        stored = load_model(outcome.path).state_dict()
        source = transformers.BloomForSequenceClassification.from_pretrained(repo / sha).state_dict()
        assert stored.keys() == source.keys() and all(torch.equal(stored[k], source[k]) for k in stored)


def test_the_articles_pipeline_pins_its_hub_tokenizer_and_model(hub_cache, tmp_path):
    refs = hub_cache / "models--bigscience--bloom-560m" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text(SHA_A)
    items = {p.stage.name: p.key.inputs for p in plan(load_pipeline("bloom-imdb"), Store(tmp_path / "s"))}
    assert items["tokenize"]["hub bigscience/bloom-560m@main"] == SHA_A
    assert items["model"]["hub bigscience/bloom-560m@main"] == SHA_A
    assert not any(k.startswith("hub ") for k in items["data"])  # served by the data mirror
