"""A retrain that reproduces its weights leaves the stages after it cached: the files that record how a
computation went (metrics.jsonl timings, TensorBoard events named by time and pid, loss.png) are verified but
out of the artifact's digest, which is what downstream keys see; weights that differ still rerun them."""

from __future__ import annotations

import helpers
from helpers import computed, needs_shared_data

from stages.engine.store import Store

pytestmark = needs_shared_data
SMALL = ("data.subset={train: 32, validation: 8, test: 8}", "train.max_steps=2", "train.eval_every=2")


def test_a_byte_identical_retrain_leaves_evaluate_and_export_cached(store_dir):
    first = helpers.run("tiny-imdb", *SMALL)
    again = helpers.run("tiny-imdb", *SMALL, force=["train"])
    assert computed(again) == {"train"}
    old, new = first["train"].manifest, again["train"].manifest
    volatile = {f["path"] for f in new["files"] + old["files"] if f.get("volatile")}
    assert "metrics.jsonl" in volatile and any(p.startswith("tensorboard/") for p in volatile)
    changed = {f["path"] for f in new["files"]} ^ {f["path"] for f in old["files"]} | {
        f["path"] for f in new["files"] for g in old["files"] if f["path"] == g["path"] and f["sha256"] != g["sha256"]}
    assert changed and changed <= volatile, changed  # only the record of the run differs, not the weights
    assert new["digest"] == old["digest"]
    assert Store(store_dir).verify_all() == {}  # volatile files are still checked against their hashes
    assert computed(helpers.run("tiny-imdb", *SMALL, "train.lr=3e-3")) == {"train", "evaluate", "export"}
