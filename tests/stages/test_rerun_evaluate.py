"""Rerunning only evaluation: evaluation settings are their own section, so changing one after a full run
executes the evaluate body and the export body downstream of it (its card carries the metrics and its
generation_config.json the settings), never a training stage, asserted from the store's events; `--only evaluate` is a cache hit when nothing changed and `--force evaluate` recomputes it."""

from __future__ import annotations

import json

import helpers
import pytest
from helpers import computed, needs_shared_data

from stages.engine.store import Store

pytestmark = needs_shared_data
BASE = ("train.max_steps=2", "evaluate.max_new_tokens=8", "evaluate.max_examples=8")
ALL = ["data", "tokenize", "model", "adapters", "train", "evaluate", "export"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A fresh store with one full tiny-billsum run in it."""
    root = tmp_path_factory.mktemp("rerun-evaluate") / "store"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FINETUNE_STORE", str(root))
        out = helpers.run("tiny-billsum", *BASE)
        assert list(out) == ALL and computed(out) == set(ALL)
        yield root, out


def new_events(store: Store, since: int) -> list[dict]:
    return store.events()[since:]


def metrics_of(outcome) -> dict:
    return json.loads((outcome.path / "metrics.json").read_text())["test"]


def test_changing_max_new_tokens_executes_evaluate_and_export_only(full_run):
    root, first = full_run
    store = Store(root)
    before = len(store.events())
    again = helpers.run("tiny-billsum", *BASE, "evaluate.max_new_tokens=3")
    events = new_events(store, before)
    rerun = {"evaluate", "export"}
    assert [(e["stage"], e["event"]) for e in events] == [(s, "computed" if s in rerun else "cached") for s in ALL]
    assert computed(again) == rerun
    for s in ALL:
        if s not in rerun:
            assert again[s].key == first[s].key
    old, new = metrics_of(first["evaluate"]), metrics_of(again["evaluate"])
    print(f"max_new_tokens 8 -> 3: generated tokens max {old['generated_tokens_max']} -> "
          f"{new['generated_tokens_max']}, mean {old['generated_tokens_mean']} -> {new['generated_tokens_mean']}")
    assert old["generated_tokens_max"] == 8 and new["generated_tokens_max"] == 3
    assert new["examples"] == old["examples"] == 8


@pytest.mark.parametrize("change", ["evaluate.splits=[validation, test]", "evaluate.batch_size=3",
                                    "evaluate.num_beams=2"])
def test_other_evaluation_settings_rerun_only_evaluate(full_run, change):
    root, first = full_run
    again = helpers.run("tiny-billsum", *BASE, change, until="evaluate")
    assert computed(again) == {"evaluate"}
    assert again["evaluate"].key != first["evaluate"].key


def test_runtime_only_evaluation_setting_changes_no_key(full_run):
    assert computed(helpers.run("tiny-billsum", *BASE, "evaluate.log_examples=0")) == set()


def test_only_evaluate_is_a_hit_and_force_evaluate_recomputes_the_same_result(full_run):
    root, first = full_run
    store = Store(root)
    before = len(store.events())
    only = helpers.run("tiny-billsum", *BASE, only="evaluate")
    assert list(only) == ["evaluate"] and computed(only) == set()
    assert [(e["stage"], e["event"]) for e in new_events(store, before)] == [("evaluate", "cached")]

    forced = helpers.run("tiny-billsum", *BASE, only="evaluate", force=["evaluate"])
    assert computed(forced) == {"evaluate"} and forced["evaluate"].reason == "forced"
    assert forced["evaluate"].key == first["evaluate"].key
    assert forced["evaluate"].manifest["digest"] == first["evaluate"].manifest["digest"]  # deterministic


def test_only_evaluate_from_the_command_line_runs_one_stage(full_run):
    root, _ = full_run
    proc = helpers.spawn(["tiny-billsum", *[a for s in BASE for a in ("--set", s)],
                          "--set", "evaluate.max_new_tokens=5", "--only", "evaluate"], root)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    stage_lines = [ln.split() for ln in output.splitlines() if ln.startswith("  ") and len(ln.split()) >= 4
                   and ln.split()[0] in ALL]
    assert [(ln[0], ln[1]) for ln in stage_lines] == [("evaluate", "computed")]


def test_only_evaluate_without_upstream_in_the_store_says_what_to_run(full_run):
    from stages.engine.errors import MissingInputError

    with pytest.raises(MissingInputError, match="run the whole pipeline first"):
        helpers.run("tiny-billsum", *BASE, "train.max_steps=1", only="evaluate")
