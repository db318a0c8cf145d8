"""Chat evaluation and data built from columns: IMDB-like rows asked and answered as a conversation
(data.format conversation), the exact_match module on short answers, and evaluate.baseline: the untuned model
on the same rows, beside the tuned one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT, SHARED_DATA, needs_shared_data, run_pipeline, subprocess_env
from test_chat import SMOLLM2, data_cfg, frames, pipeline_file, render, trained, write_jsonl

from stages.data import check_rows, normalise
from stages.engine.errors import ConfigError, DataError
from stages.engine.store import Store
from stages.methods import metrics
from stages.models.hf import load_tokenizer
from stages.pipeline.schema import PipelineConfig

QUESTION = "{text}\n\nIs this movie review positive or negative? Answer with one word."
TURNS = {"system": "Be brief.", "user": QUESTION, "assistant": "{label}"}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(PipelineConfig.model_validate({"name": "t", "method": "sft", "model": {"name": SMOLLM2}}))


def test_a_labelled_row_becomes_a_conversation_rendered_and_masked(tok):
    cfg = data_cfg(format="conversation", conversation=TURNS, label_names=["negative", "positive"])
    got = normalise(frames([{"text": "Great {fun} film.", "label": 1}, {"text": "Dull.", "label": 0}]), cfg)["train"]
    assert got["messages"][0] == [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Great {fun} film.\n\nIs this movie review positive "
                                                              "or negative? Answer with one word."},
                                  {"role": "assistant", "content": "positive"}]
    assert list(got["target"]) == ["positive", "negative"]
    ids, labels, _, _ = render(tok, got["messages"][0], max_length=128)
    assert tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nGreat {fun} film.\n\n"
                               "Is this movie review positive or negative? Answer with one word.<|im_end|>\n"
                               "<|im_start|>assistant\npositive<|im_end|>\n")
    assert [s for s, on in trained(tok, ids, labels) if on] == ["positive", "<|im_end|>", "\n"]


def test_label_is_the_class_of_data_label_column_by_id_or_by_name():
    turns = {"user": "{text}", "assistant": "{label}"}
    ids = data_cfg(format="conversation", conversation=turns, label_column="kind", label_names=["neg", "pos"])
    got = normalise(frames([{"text": "a", "kind": 1}, {"text": "b", "kind": 0}]), ids)["train"]
    assert list(got["target"]) == ["pos", "neg"]
    names = data_cfg(format="conversation", conversation=turns, label_column="kind")
    got = normalise(frames([{"text": "a", "kind": "short"}, {"text": "b", "kind": "long"}]), names)["train"]
    assert list(got["target"]) == ["short", "long"]
    listed = data_cfg(format="conversation", conversation=turns, label_column="kind", label_names=["neg", "pos"])
    with pytest.raises(DataError, match=r"^train split, row 1, field 'kind': 'meh' is not one of "
                                        r"data.label_names \['neg', 'pos'\]; add it there or fix the row$"):
        normalise(frames([{"text": "a", "kind": "pos"}, {"text": "b", "kind": "meh"}]), listed)
    with pytest.raises(DataError, match=r"field 'kind': 2 is not a class id of data.label_names"):
        normalise(frames([{"text": "a", "kind": 2}]), listed)


def test_an_unknown_field_or_a_missing_turn_is_one_line():
    cfg = data_cfg(format="conversation", conversation={"user": "{review}", "assistant": "{label}"})
    with pytest.raises(ConfigError, match=r"^data.conversation: \{review\} is not a column of train split "
                                          r"\(columns: text, label\); write one of those in braces$"):
        normalise(frames([{"text": "x", "label": 1}]), cfg)
    with pytest.raises(ValueError, match="set data.conversation with at least user and assistant"):
        data_cfg(format="conversation", conversation={"user": "{text}"})


def test_exact_match_compares_the_first_words_after_normalising():
    preds = ["Positive.", "negative, clearly", "This review is positive", "", "NEW YORK city", "positive"]
    refs = ["positive", "negative", "positive", "negative", "new york", "negative"]
    assert metrics.compute(["exact_match"], preds, refs) == {"exact_match": 3 / 6}
    assert metrics.compute(["exact_match"], [], []) == {"exact_match": 0.0}


def test_the_baseline_is_the_untuned_model_on_the_same_rows(tmp_path):
    from stages.pipeline.loading import load_pipeline

    rows = [{"text": f"Review {i}: " + " ".join(["fine", "bad"][i % 2] for _ in range(3 + i % 5)), "label": i % 2}
            for i in range(40)]
    data = {"format": "conversation", "conversation": TURNS, "label_names": ["negative", "positive"],
            "split": {"mode": "source", "seed": 1, "validation": 4, "test": 8}}
    f = pipeline_file(tmp_path, write_jsonl(tmp_path / "reviews.jsonl", rows), data=data,
                      adapters={"method": "lora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                      train={"micro_batch_size": 8, "lr": 5e-2, "max_steps": 6},
                      evaluate={"max_new_tokens": 3, "splits": ["test"], "metrics": ["exact_match", "rouge"],
                                "baseline": True})
    store = Store(tmp_path / "s")
    out = {o.stage: o for o in run_pipeline(load_pipeline("mychat", [], path=f), store, until="evaluate")}
    ev = out["evaluate"]
    m = ev.manifest["metrics"]
    tuned, base = m["splits"]["test"], m["baseline"]["test"]
    assert {"exact_match", "rouge1"} <= set(tuned) and {"exact_match", "rouge1"} <= set(base)
    assert json.loads((ev.path / "baseline_metrics.json").read_text()) == m["baseline"]
    base_preds = [json.loads(x)["prediction"] for x in (ev.path / "baseline_predictions.jsonl").read_text().splitlines()]
    preds = [json.loads(x)["prediction"] for x in (ev.path / "predictions.jsonl").read_text().splitlines()]
    assert len(base_preds) == len(preds) == 8 and base_preds != preds  # six steps at a high lr moved the answers
    # `inspect runs` shows the tuned model's exact_match first (not ROUGE's four, not the baseline's)
    from flows.reports import runs

    (run,) = json.loads(runs.report(store, as_json=True))
    assert run["metrics"]["splits.test.exact_match"] == tuned["exact_match"] and \
        not any(k.startswith("baseline.") for k in run["metrics"]), run["metrics"]
    assert "splits.test.exact_match=" in runs.report(store)

    # the untuned model evaluated on its own: one step at lr 1e-30 leaves LoRA's B at 0 (lr 0 is refused)
    g = pipeline_file(tmp_path, write_jsonl(tmp_path / "reviews.jsonl", rows), data=data,
                      adapters={"method": "lora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                      train={"micro_batch_size": 8, "lr": 1e-30, "max_steps": 1},
                      evaluate={"max_new_tokens": 3, "splits": ["test"], "metrics": ["exact_match", "rouge"]})
    untouched = {o.stage: o for o in run_pipeline(load_pipeline("mychat", [], path=g), store, until="evaluate")}
    again = [json.loads(x)["prediction"]
             for x in (untouched["evaluate"].path / "predictions.jsonl").read_text().splitlines()]
    assert again == base_preds
    assert untouched["evaluate"].manifest["metrics"]["splits"]["test"] == base


@needs_shared_data
def test_an_unknown_field_of_the_mirrors_data_is_refused_at_plan_time_nothing_written(tmp_path, monkeypatch):
    """The shipped smol-chat reads IMDB from the offline mirror: a {field} its files lack is one line, exit 2,
    before any stage runs (the mirror's header names the columns), not after the data stage read 50k rows."""
    store = tmp_path / "store"
    p = subprocess.run([sys.executable, "-m", "stages", "smol-chat", "--set", 'data.conversation.user="{review}"'],
                       cwd=ROOT, env=subprocess_env(store), capture_output=True, text=True, timeout=120)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert err[0].endswith("data.conversation: {review} is not a column of "
                           f"{SHARED_DATA / 'imdb' / 'test.csv.gz'} (columns: text, label); write one of those "
                           "in braces")
    assert not store.exists() or not any(store.glob("data/*"))
    monkeypatch.delenv("FINETUNE_DATA_MIRROR", raising=False)  # no mirror: the hub's dataset's columns
    hub = PipelineConfig.model_validate({"name": "t", "data": {"source": "imdb", "mirror": "/nowhere",
                                                               "format": "conversation", "conversation": TURNS | {
                                                                   "assistant": "{sentiment}"}},
                                         "method": "sft", "model": {"name": SMOLLM2, "num_labels": None}})
    with pytest.raises(ConfigError, match=r"^data.conversation: \{sentiment\} is not a column of the hub's imdb "
                                          r"\(columns: text, label\)"):
        check_rows(hub)
