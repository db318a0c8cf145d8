"""Stage.joins: a run that only takes part in another machine's computation of a stage (a training across
machines, on machine_rank > 0) runs the body outside the store: no lease, nothing committed, and the
pipeline stops after it."""

from __future__ import annotations

import threading

from helpers import plan, run_pipeline

from stages.engine.stage import JOINED, Stage
from stages.engine.store import Store
from stages.pipeline.loading import load_pipeline

RAN: list[str] = []


def produce(ctx) -> dict:
    RAN.append("produce")
    (ctx.out_dir / "x.txt").write_text("x")
    return {}


def helper_body(ctx) -> dict:
    RAN.append("helper")
    (ctx.out_dir / "partial.txt").write_text("only machine 0 commits")
    return {"part": 1}


def after(ctx) -> dict:
    RAN.append("after")
    return {}


def graph(joining: bool) -> list[Stage]:
    return [Stage(name="data", body=produce, reads=("data",)),
            Stage(name="train", body=helper_body, reads=("train",), upstream=("data",),
                  joins=lambda cfg: "helping machine 0" if joining else None),
            Stage(name="evaluate", body=after, reads=("evaluate",), upstream=("train",))]


def test_a_joined_stage_takes_no_lease_commits_nothing_and_ends_the_run(tmp_path):
    cfg, store = load_pipeline("tiny-imdb", []), Store(tmp_path / "store")
    key = plan(cfg, store, graph(True))[1].key.key
    RAN.clear()
    result: dict = {}
    with store.lock(key, "train"):  # machine 0 holds the key while it computes
        t = threading.Thread(target=lambda: result.update(out=run_pipeline(cfg, store, graph(True))), daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the joined stage waited for the key's lease"
    outs = result["out"]
    assert RAN == ["produce", "helper"] and [o.stage for o in outs] == ["data", "train"]
    assert outs[1].reason == JOINED and outs[1].manifest["metrics"] == {"part": 1}
    assert store.read_manifest("train", key) is None and "train" not in store.refs("tiny-imdb")
    assert [e["stage"] for e in store.events()] == ["data"]
    # machine 0's committed artifact is reused when it is there already: nothing left to join
    RAN.clear()
    assert [o.computed for o in run_pipeline(cfg, store, graph(False))] == [False, True, True]
    RAN.clear()
    outs = run_pipeline(cfg, store, graph(True))
    assert RAN == [] and [(o.computed, o.reason) for o in outs] == [(False, "cached")] * 3
