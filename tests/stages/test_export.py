"""The export stage: the exported adapter (reloaded on its base), the merged model at the top of the folder and
a full finetune's model give the evaluated model's logits on the same batch; the model card names what
reproduces it. (test_export_standalone.py loads the folder in a fresh interpreter without this project.)"""

from __future__ import annotations

import json
import shlex

import helpers
import pytest
import torch
import yaml
from helpers import BILLSUM, IMDB, needs_shared_data, plan

from stages.evaluate import load_evaluated
from stages.methods import method_of
from stages.models.compat.bitsandbytes import exact_cpu_kernels
from stages.models.model_loading import load_model
from stages.pipeline.loading import load_pipeline

pytestmark = needs_shared_data

IMDB_LORA = ("adapters.method=lora", "adapters.target_modules=[query_key_value, dense]",
             "adapters.modules_to_save=[score]")
# bitsandbytes' CPU 4-bit kernels need layers at least 64 wide
T5_4BIT = ("quantization.mode=4bit", "model.from_config.d_model=64", "model.from_config.d_kv=16",
           "model.from_config.d_ff=128", "evaluate.max_examples=4")
TOL = 1e-5


def evaluated_and_batch(out: dict, task: str):
    import datasets

    ds = datasets.load_from_disk(str(out["tokenize"].path / "dataset"))["test"]
    b = method_of(task).collate([ds[i] for i in range(4)], 0)
    model = load_evaluated(out["model"].path, out["adapters"].path, out["train"].path)
    return model, b


@torch.no_grad()
def logits(model: torch.nn.Module, b, task: str) -> torch.Tensor:
    model.eval()
    if task == "seq_cls":
        return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).logits


def auto(task: str):
    import transformers

    return {"seq_cls": transformers.AutoModelForSequenceClassification,
            "seq2seq": transformers.AutoModelForSeq2SeqLM}[task]


@pytest.mark.parametrize("pipeline,sets,task", [
    ("tiny-billsum", BILLSUM, "seq2seq"),
    ("tiny-imdb", IMDB + IMDB_LORA, "seq_cls"),
    ("tiny-billsum", BILLSUM + T5_4BIT, "seq2seq"),
], ids=["t5-lora", "bloom-classifier-lora", "t5-qlora-4bit"])
def test_exported_adapter_and_merged_model_give_the_evaluated_logits(store, pipeline, sets, task, caplog):
    from peft import PeftModel
    from transformers import AutoTokenizer

    with caplog.at_level("INFO", logger="finetune"):  # train forced: its log line is this run's (the store is shared)
        out = helpers.run(pipeline, *sets, "export.merge=true", force=("train",))
    ex = out["export"].path
    # one parameter count (a packed 4-bit weight counted as the weights it holds): the adapters stage's is
    # the train log's, train's metrics' and the model card's
    a = out["adapters"].manifest["metrics"]
    assert out["train"].manifest["metrics"]["total_params"] == a["total"]
    assert f"{a['trainable']} trainable of {a['total']} params" in caplog.text
    assert f"| total_params | {a['total']} |" in (ex / "README.md").read_text()
    model, b = evaluated_and_batch(out, task)
    ref = logits(model, b, task)

    adapter = PeftModel.from_pretrained(load_model(out["model"].path), str(ex / "adapter"))
    # bitsandbytes' CPU inference kernel for 4-bit layers runs in bf16 (~3e-2 here); evaluate uses fp32
    exact_cpu_kernels(adapter)
    merged = auto(task).from_pretrained(str(ex))  # a random-init base: the merged model is at the top
    d_adapter = float((logits(adapter, b, task) - ref).abs().max())
    d_merged = float((logits(merged, b, task) - ref).abs().max())
    print(f"{pipeline} {' '.join(sets[len(BILLSUM):] or sets[-1:])}: max |logits - evaluated|: adapter {d_adapter:.2e}, merged "
          f"{d_merged:.2e} (logits up to {float(ref.abs().max()):.2f})")
    assert d_adapter <= TOL and d_merged <= TOL
    assert float(ref.abs().max()) > 1e-2  # not trivially zero

    assert not any(hasattr(m, "lora_A") for m in merged.modules())  # merged, not wrapped
    assert {type(m).__name__ for m in merged.modules()}.isdisjoint({"Linear4bit", "Linear8bitLt"})
    assert "quantization_config" not in json.loads((ex / "config.json").read_text())
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    assert AutoTokenizer.from_pretrained(str(ex)).pad_token_id is not None
    assert not (ex / "merged").exists()  # merged is the top already
    cfg = json.loads((ex / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and (ex / "adapter" / "adapter_model.safetensors").is_file()
    facts = out["export"].manifest["metrics"]
    assert facts["merged"] and facts["layout"] == "merged" and facts["dequantized_from"] == ("4bit" if "quantization.mode=4bit" in sets else None)


def test_full_finetune_exports_the_model_itself(store):
    out = helpers.run("tiny-imdb", *IMDB)
    ex = out["export"].path
    assert not (ex / "adapter").exists() and not (ex / "merged").exists()
    model, b = evaluated_and_batch(out, "seq_cls")
    exported = auto("seq_cls").from_pretrained(str(ex))
    d = float((logits(exported, b, "seq_cls") - logits(model, b, "seq_cls")).abs().max())
    print(f"full finetune: max |logits(export/model) - evaluated| = {d:.2e}")
    assert d <= TOL
    assert (ex / "tokenizer.json").is_file()
    assert json.loads((ex / "config.json").read_text())["id2label"] == {"0": "neg", "1": "pos"}
    sets = command_reproduces(out, "tiny-imdb")  # a mapping-valued --set (data.subset) round-trips
    assert any(s.startswith("data.subset=") for s in sets)


def test_model_card_names_pipeline_keys_metrics_and_a_command_that_reproduces_them(store):
    # data.split.train: tiny-billsum splits in mode source, which ignores it; so do the keys, the card and the files
    out = helpers.run("tiny-billsum", *BILLSUM, "export.merge=true", "data.split.train=50")
    card = (out["export"].path / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\npipeline_tag: text2text-generation\n")
    assert "# tiny-billsum" in card
    assert "tiny T5 summariser on the 100 real billsum bills" in card  # the description
    for stage in ("data", "tokenize", "model", "adapters", "train", "evaluate"):
        assert f"| {stage} | `{out[stage].key}` |" in card
    final = out["train"].manifest["metrics"]["final_loss"]
    assert f"| final_loss | {round(final, 6)} |" in card
    rouge = out["evaluate"].manifest["metrics"]["splits"]["test"]["rouge1"]
    assert f"| test | rouge1 | {round(rouge, 4)} |" in card
    config = json.loads((out["export"].path / "finetune_pipeline.json").read_text())
    assert config["name"] == "tiny-billsum" and config["train"]["max_steps"] == 2
    assert config["data"]["split"] == {"mode": "source", "seed": 42, "train": None, "validation": 10, "test": 20}
    exported = yaml.safe_load((out["export"].path / "finetune_pipeline.yaml").read_text())
    assert exported["pipelines"]["tiny-billsum"]["data"]["split"] == {"seed": 42, "validation": 10, "test": 20}
    assert "data.split.train" not in card and "train: 50" not in card
    assert not (out["export"].path / "config.json").read_text().count("max_steps")  # the model's config

    # the run's own --set list (not a diff against pipeline.yaml re-read at export time), less its runtime
    # settings; the metrics and generation_config.json are evaluate's, so an evaluation change re-exports
    assert command_reproduces(out, "tiny-billsum") == ["train.max_steps=2", "evaluate.max_new_tokens=8",
                                                       "export.merge=true"]
    again = helpers.run("tiny-billsum", *BILLSUM, "export.merge=true", "train.log_every=1")
    assert again["export"].key == out["export"].key and helpers.computed(again) == set()
    gen = json.loads((out["export"].path / "generation_config.json").read_text())
    assert gen["max_new_tokens"] == 8 and gen["num_beams"] == 1


def test_a_setting_the_split_mode_ignores_is_in_no_key(tmp_path):
    """split.train under mode source is read by nothing: set in the pipeline file or by --set, every stage's
    key (export's, which holds the --set list, too) is the one without it. Under shuffle_concat it is read."""
    keys = lambda cfg: {p.stage.name: p.key.key for p in plan(cfg)}  # noqa: E731
    plain = keys(load_pipeline("tiny-billsum", list(BILLSUM)))
    assert keys(load_pipeline("tiny-billsum", [*BILLSUM, "data.split.train=50"])) == plain
    files = []
    for i, split in enumerate(("{train: 50}", "{seed: 42}")):
        files.append(tmp_path / f"mine{i}.yaml")
        files[-1].write_text(f"pipelines:\n  mine:\n    extends: tiny-billsum\n    data:\n      split: {split}\n")
    assert keys(load_pipeline("mine", list(BILLSUM), files[0])) == keys(load_pipeline("mine", list(BILLSUM), files[1]))
    concat = ["data.split={mode: shuffle_concat, train: 50, validation: 10, test: 20}"]
    assert keys(load_pipeline("tiny-billsum", concat))["data"] != \
        keys(load_pipeline("tiny-billsum", [*concat, "data.split.train=60"]))["data"]


def command_reproduces(out: dict, name: str) -> list[str]:
    """The command in the card, parsed and planned with the shipped finetune_pipeline.yaml, gives the very
    same keys for every stage. Returns its --set values."""
    ex = out["export"].path
    card = (ex / "README.md").read_text()
    line = next(ln for ln in card.splitlines() if ln.startswith("finetune run "))
    argv = shlex.split(line)[2:]
    assert argv[0] == name and argv[1:3] == ["--config", "finetune_pipeline.yaml"]
    sets = [argv[i + 1] for i in range(3, len(argv), 2) if argv[i] == "--set"]
    keys = {p.stage.name: p.key.key for p in plan(load_pipeline(argv[0], sets, ex / argv[2]))}
    for stage in ("data", "tokenize", "model", "adapters", "train", "evaluate", "export"):
        assert keys[stage] == out[stage].key, stage
    return sets


def test_what_sits_at_the_top_of_the_folder_and_an_adapter_that_cannot_load_alone():
    from stages.engine.errors import ConfigError
    from stages.formats.export_layout import top_layout

    hub_t5 = ["model.name=acme/tiny-t5", "model.from_config=null"]
    assert top_layout(load_pipeline("tiny-billsum")) == "merged"  # a random-init base: nothing to fetch
    assert top_layout(load_pipeline("tiny-billsum", hub_t5)) == "adapter"  # hub id + pinned commit
    assert top_layout(load_pipeline("tiny-billsum", [*hub_t5, "quantization.mode=4bit"])) == "merged"
    assert top_layout(load_pipeline("tiny-billsum", [*hub_t5, "export.layout=merged"])) == "merged"
    assert top_layout(load_pipeline("tiny-imdb")) == "model"  # full finetune
    with pytest.raises(ConfigError, match=r"^export.layout adapter: .*its base is not on a hub.*auto or merged$"):
        top_layout(load_pipeline("tiny-billsum", ["export.layout=adapter"]))
    lora_cls = ["model.name=acme/bloom", "model.from_config=null", *IMDB_LORA, "export.layout=adapter"]
    with pytest.raises(ConfigError, match="a classifier's head is new"):
        top_layout(load_pipeline("tiny-imdb", lora_cls))


@pytest.mark.parametrize("sets,why", [
    (["export.layout=adapter"], "its base is not on a hub"),
    (["model.name=acme/bloom", "model.from_config=null", *IMDB_LORA, "export.layout=adapter"],
     "a classifier's head is new (its size and labels are this run's), so the hub base cannot rebuild it"),
], ids=["random-base", "hub-classifier"])
def test_an_adapter_that_cannot_load_alone_is_refused_before_prefect_and_any_stage(tmp_path, sets, why):
    """Known from the config: one line, exit 2, from the flow's entry point on a fresh store, with nothing
    written (no store, no Prefect home), not after training."""
    import subprocess
    import sys
    import time

    pipeline = "tiny-billsum" if len(sets) == 1 else "tiny-imdb"
    env = {"PATH": "/usr/bin:/bin", "FINETUNE_STORE": str(tmp_path / "store"), "HF_HUB_OFFLINE": "1",
           "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONPATH": str(helpers.ROOT)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flows.finetune", pipeline, *(a for x in sets for a in ("--set", x))],
                          cwd=helpers.ROOT, env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (
        2, f"error: export.layout adapter: the adapter alone cannot load from the export folder ({why}); set "
           f"export.layout to auto or merged", "")
    assert not (tmp_path / "store").exists() and not (tmp_path / "prefect").exists()
    assert took < 10, took
