"""The export folder stands alone: a fresh interpreter (`python -I`, cwd outside the repo, HF_HUB_OFFLINE=1) that
imports only torch, transformers and peft loads it from its path and reproduces the evaluate stage's test-split
predictions exactly (every label; every generated text), per model family. The card's usage snippet runs as
written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import helpers
import pytest
import torch
import transformers
from helpers import BILLSUM, IMDB, needs_shared_data

from stages.sources.arrow import read_split

pytestmark = needs_shared_data

# loads FOLDER as a user would and prints one prediction per text (texts.json), in order
LOADER = r'''
import json, sys
import torch, transformers, peft
folder, texts = sys.argv[1], json.load(open(sys.argv[2]))
settings = json.load(open(folder + "/finetune_pipeline.json"))
task, prefix = settings["method"]["name"], settings["tokenize"]["prefix"]
adapter = __import__("os").path.exists(folder + "/adapter_config.json")
lib = peft if adapter else transformers
name = {"classify": "AutoModelForSequenceClassification", "seq2seq": "AutoModelForSeq2SeqLM",
        "sft": "AutoModelForCausalLM"}[task]
model = getattr(lib, name.replace("AutoModel", "AutoPeftModel") if adapter else name).from_pretrained(folder).eval()
tok = transformers.AutoTokenizer.from_pretrained(folder)
batch = tok([prefix + t for t in texts], truncation=True, padding=True, return_tensors="pt")
with torch.no_grad():
    if task == "classify":
        logits = model(**batch).logits
        out = [model.config.id2label[int(i)] for i in logits.argmax(-1)]
        print(json.dumps(logits.tolist()))
    else:
        kw = {"generation_config": transformers.GenerationConfig.from_pretrained(folder)} if adapter else {}
        out = [t.strip() for t in tok.batch_decode(model.generate(**batch, **kw), skip_special_tokens=True)]
assert not any(m.split(".")[0] in ("stages", "flows") for m in sys.modules)
print(json.dumps(out))
'''


def isolated(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -I` in `cwd` (outside the repo): no PYTHONPATH, no user site, offline."""
    base = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HOME": str(cwd),
            "TOKENIZERS_PARALLELISM": "false", **env}
    return subprocess.run([sys.executable, "-I", *args], cwd=cwd, env=base, capture_output=True, text=True,
                          timeout=300)


def evaluated(out: dict, split: str = "test") -> tuple[list[str], list]:
    """(input texts, the evaluate stage's predictions) of a split, in the order evaluate wrote them."""
    recs = [json.loads(ln) for ln in (out["evaluate"].path / "predictions.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["split"] == split]
    table = read_split(out["data"].path, split)
    text = dict(zip([str(i) for i in table.column("id").to_pylist()], table.column("text").to_pylist(), strict=True))
    return [text[r["id"]] for r in recs], [r["prediction"] for r in recs]


def reproduce(out: dict, tmp_path: Path, **env: str) -> None:
    texts, expected = evaluated(out)
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    (tmp_path / "load.py").write_text(LOADER)
    r = isolated([str(tmp_path / "load.py"), str(out["export"].path), str(tmp_path / "texts.json")], tmp_path, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    got = json.loads(lines[-1])
    print(f"{len(got)} predictions from the export, {sum(g == e for g, e in zip(got, expected, strict=True))} "
          f"equal to evaluate's; e.g. {got[:2]!r}")
    assert got == expected
    if out["export"].manifest["metrics"].get("layout") != "adapter" and isinstance(expected[0], str) and \
            json.loads((out["export"].path / "finetune_pipeline.json").read_text())["method"]["name"] == "classify":
        # equal labels could be one class for all: the logits themselves are the evaluated model's
        d = float((torch.tensor(json.loads(lines[-2])) - evaluated_logits(out, len(got))).abs().max())
        print(f"max |logits(export, fresh interpreter) - evaluated model's| = {d:.2e}")
        assert d < 1e-4


def evaluated_logits(out: dict, n: int) -> torch.Tensor:
    import datasets

    from stages.evaluate import load_evaluated
    from stages.models.inference import class_logits

    rows = datasets.load_from_disk(str(out["tokenize"].path / "dataset"))["test"]["input_ids"][:n]
    model = load_evaluated(out["model"].path, out["adapters"].path, out["train"].path)
    return class_logits(model, rows, 0, 8, torch.device("cpu"), "reference")


DEMO = ("data.subset={train: 16, validation: 8, test: 24}", "tokenize.max_length=64", "train.max_steps=2",
        "train.eval_every=null", "train.select_best=null")
T5_4BIT = ("quantization.mode=4bit", "model.from_config.d_model=64", "model.from_config.d_kv=16",
           "model.from_config.d_ff=128", "evaluate.max_examples=6")


@pytest.mark.parametrize("pipeline,sets,top", [
    ("demo", DEMO, "merged"),
    ("tiny-billsum", BILLSUM, "merged"),
    ("tiny-billsum", BILLSUM + T5_4BIT, "merged"),
    ("tiny-imdb", IMDB, "model"),
], ids=["minilm-lora-package-base", "t5-lora", "t5-qlora-4bit-merged", "full-finetune"])
def test_export_loads_alone_and_reproduces_the_evaluated_predictions(store, tmp_path, pipeline, sets, top):
    out = helpers.run(pipeline, *sets)
    ex = out["export"].path
    assert out["export"].manifest["metrics"]["layout"] == top
    assert (ex / "config.json").is_file() and (ex / "model.safetensors").is_file()
    assert not (ex / "config.json").read_text().count("quantization_config")
    assert json.loads((ex / "finetune_pipeline.json").read_text())["name"] == pipeline
    if out["adapters"].manifest["metrics"].get("method", "lora") == "lora" and top == "merged":
        assert (ex / "adapter" / "adapter_config.json").is_file()
    reproduce(out, tmp_path)


REPO = "acme/tiny-t5"
SHA = "c0ffee0" + "2" * 33


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A fake HF cache holding one snapshot of a tiny T5 at SHA, refs/main -> SHA."""
    import huggingface_hub.constants

    cache = tmp_path / "hf-hub"
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=30522,
                                   decoder_start_token_id=0)
    repo = cache / f"models--{REPO.replace('/', '--')}"
    transformers.T5ForConditionalGeneration(config).save_pretrained(repo / "snapshots" / SHA)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_base_exports_the_adapter_with_its_id_and_pinned_commit(tmp_path, hub_cache, monkeypatch):
    monkeypatch.setenv("FINETUNE_STORE", str(tmp_path / "store"))
    out = helpers.run("tiny-billsum", *BILLSUM, f"model.name={REPO}", "model.from_config=null")
    ex = out["export"].path
    cfg = json.loads((ex / "adapter_config.json").read_text())
    assert (cfg["base_model_name_or_path"], cfg["revision"]) == (REPO, SHA)
    assert (ex / "adapter_model.safetensors").is_file() and not (ex / "config.json").exists()
    card = (ex / "README.md").read_text()
    assert f"base_model: {REPO}\nlibrary_name: peft\n" in card
    reproduce(out, tmp_path, HF_HUB_CACHE=str(hub_cache))


def snippet(card: str) -> str:
    return re.search(r"## Usage\n.*?```python\n(.*?)```", card, re.S).group(1)


@pytest.mark.parametrize("pipeline,sets", [("tiny-imdb", IMDB), ("tiny-billsum", BILLSUM)],
                         ids=["classifier", "seq2seq"])
def test_the_cards_usage_snippet_runs_as_written(store, tmp_path, pipeline, sets):
    out = helpers.run(pipeline, *sets)
    ex = out["export"].path
    card = (ex / "README.md").read_text()
    assert card.startswith("---\n") and "\npipeline_tag: " in card and "\nmodel-index:\n" in card
    metric = "accuracy" if pipeline == "tiny-imdb" else "rouge1"
    value = out["evaluate"].manifest["metrics"]["splits"]["test"][metric]
    assert f"type: {metric}\n      name: test {metric}\n      value: {round(value, 6)}" in card
    (tmp_path / "usage.py").write_text(snippet(card))
    r = isolated([str(tmp_path / "usage.py")], ex)  # "from this folder"
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    print("\n".join(lines))
    if pipeline == "tiny-imdb":
        names = json.loads((ex / "config.json").read_text())["id2label"].values()
        assert len(lines) == 2 and all(ln.split()[0] in names for ln in lines)
    else:
        assert len(lines) == 1
