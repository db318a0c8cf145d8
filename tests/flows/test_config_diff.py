"""`finetune inspect diff`'s params: one row per field where the two configs differ in kind, never `None -> None`
(a null field on one side and a mapping on the other is one row with both values)."""

from __future__ import annotations

from flows.reports.config_diff import _changed, _sections, render_diff
from stages.pipeline.loading import load_pipeline


def test_a_null_field_against_a_mapping_is_one_row_with_both_values():
    a, b = _sections(load_pipeline("demo")), _sections(load_pipeline("tiny-imdb"))
    rows = {r["param"]: r for r in _changed(a, b)}
    assert rows["model.from_config"]["a"] is None and rows["model.from_config"]["b"]["model_type"] == "bloom"
    assert not any(k.startswith("model.from_config.") for k in rows)  # not one row per key of the mapping
    assert rows["train.select_best"]["a"] == {"metric": "val_loss", "mode": "min"}
    assert rows["train.select_best"]["b"] is None and rows["train.eval_every"]["b"] is None  # a real null
    d = {"a": {"pipeline": "demo", "overrides": []}, "b": {"pipeline": "tiny-imdb", "overrides": []},
         "stages": [], "params": list(rows.values()), "metrics": []}
    text = render_diff(d)
    assert "None -> None" not in text
    assert "model.from_config" in text and "None -> {model_type:bloom" in text


def test_a_key_one_side_lacks_shows_as_a_dash():
    rows = _changed({"model": {"from_config": {"a": 1}}}, {"model": {"from_config": {"a": 1, "b": 2}}})
    assert rows == [{"param": "model.from_config.b", "a": None, "b": 2, "a_set": False, "b_set": True}]
    text = render_diff({"a": {"pipeline": "x", "overrides": []}, "b": {"pipeline": "x", "overrides": []},
                        "stages": [], "params": rows, "metrics": []})
    assert "model.from_config.b" in text and "- -> 2" in text
