"""The Task registry (stages/methods/tasks.py): what differs between tasks lives in one object per task, and
adding a task is one new object: a sequence-regression task is added here and trained through the unchanged
train loop (collate, summed loss and its units, validation all come from the object)."""

from __future__ import annotations

import logging
import re
import typing

import pytest
import torch
from helpers import ROOT

from stages.engine.errors import ConfigError
from stages.methods.tasks import TASK_DATA, TASKS, Classification, Task, TaskData, task_of
from stages.pipeline.schema import VALIDATION_METRICS, ModelConfig
from stages.training.batching import collate

log = logging.getLogger("test.tasks")
BRANCH = re.compile(r"\btask\s*(==|!=)|\btask\s+(not\s+)?in\s*[(\[{]|\.task\s*(==|!=)")


def test_no_module_outside_the_registry_branches_on_the_task():
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for pkg in ("stages", "flows") for p in sorted((ROOT / pkg).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if BRANCH.search(line) and p.name != "tasks.py"]
    assert not found, "a task branch outside stages/methods/tasks.py: move it into the Task objects\n" + "\n".join(found)


def test_the_registry_holds_exactly_the_tasks_the_schema_accepts_and_each_names_real_classes():
    import peft
    import transformers

    choices = typing.get_args(ModelConfig.model_fields["task"].annotation)
    assert set(TASKS) == set(choices) == set(VALIDATION_METRICS) == set(TASK_DATA)
    for name, task in TASKS.items():
        assert task.name == name and task.predicts in ("labels", "texts")
        assert hasattr(transformers, task.auto_class) and hasattr(peft, task.auto_peft_class)
        assert peft.TaskType[task.peft_task_type]
        assert task.validation_metrics[0] == "loss"
        assert task.generates != task.classifies  # a task predicts classes or generates text
    with pytest.raises(ConfigError, match=r"^model.task: 'seq_clss' is not one of seq_cls, seq2seq, causal_lm"):
        task_of("seq_clss")


# ---------------------------------------------------------------- a task added: one object


class Regression(Classification):
    """seq_reg: one score per text (a head of size 1), mean squared error; validation adds the mean absolute
    error. Everything else (loading, padding, evaluation's batching) is the classifier's."""

    name = "seq_reg"

    @property
    def validation_metrics(self) -> tuple[str, ...]:
        return ("loss", "mae")

    def label_tensor(self, rows: list[dict]) -> torch.Tensor:
        return torch.as_tensor([float(r["labels"]) for r in rows], dtype=torch.float32)

    def summed_loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        pred = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float().squeeze(-1)
        return torch.nn.functional.mse_loss(pred, batch.labels, reduction="sum")

    def validation_pass(self, model, rows, order, pad_id, batch_size, device, module, tok) -> dict[str, float]:
        loss, err = 0.0, 0.0
        for i in range(0, len(order), batch_size):
            b = self.collate(rows.get(order[i:i + batch_size]), pad_id).to(device)
            pred = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float().squeeze(-1)
            loss += float(torch.nn.functional.mse_loss(pred, b.labels, reduction="sum"))
            err += float((pred - b.labels).abs().sum())
        return {"val_loss": round(loss / len(rows), 6), "val_mae": round(err / len(rows), 6)}


def regression_rows(n: int, seed: int) -> list[dict]:
    """The label is the share of low token ids in the text (learnable from the tokens alone)."""
    from tiny_train import VOCAB, cls_rows

    rows = cls_rows(n, seed=seed)
    return [{**r, "labels": sum(t < VOCAB // 2 for t in r["input_ids"]) / len(r["input_ids"])} for r in rows]


def tiny_regressor(seed: int = 0) -> torch.nn.Module:
    from tiny_train import PAD, VOCAB
    from transformers import BloomConfig, BloomForSequenceClassification

    torch.manual_seed(seed)
    return BloomForSequenceClassification(BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB,
                                                      pad_token_id=PAD, num_labels=1, hidden_dropout=0.0,
                                                      attention_dropout=0.0, problem_type="regression"))


@pytest.fixture
def regression(monkeypatch) -> Task:
    task = Regression()
    monkeypatch.setitem(TASKS, task.name, task)
    monkeypatch.setitem(TASK_DATA, task.name, TaskData(classifies=True, source_target=False))
    return task


def test_an_added_task_trains_through_the_unchanged_loop(regression, tmp_path):
    from tiny_train import PAD, tcfg

    from stages.train import train_model

    rows, val = regression_rows(96, seed=1), regression_rows(24, seed=2)
    assert collate(rows[:2], PAD, regression).labels.dtype == torch.float32
    m = train_model(tiny_regressor(), rows, val, tcfg(micro_batch_size=8, gradient_accumulation_steps=2, epochs=6,
                                                      lr=3e-3), "seq_reg", PAD, tmp_path / "out", tmp_path / "work", log)
    first, last = m["validation"][0], m["validation"][-1]
    print(f"seq_reg: train loss {m['first_loss']:.4f} -> {m['final_loss']:.4f}; validation {first} -> {last}")
    assert m["final_loss"] < 0.5 * m["first_loss"]
    assert set(last) >= {"val_loss", "val_mae"} and last["val_mae"] < first["val_mae"]


def test_an_added_task_keeps_k_by_1_equal_to_1_by_k(regression, tmp_path, monkeypatch):
    """Its loss is summed and divided by the window's units: micro-batch 8 x accumulation 1 and 1 x 8 give
    the same gradients."""
    from tiny_train import max_diff, window_grads

    rows = regression_rows(8, seed=3)
    big = window_grads(tiny_regressor, rows, 8, "seq_reg", tmp_path, monkeypatch)
    small = window_grads(tiny_regressor, rows, 1, "seq_reg", tmp_path, monkeypatch)
    print(f"seq_reg: max |grad(8x1) - grad(1x8)| = {max_diff(big, small):.2e}")
    assert max(float(g.abs().max()) for g in big.values()) > 1e-3 and max_diff(big, small) < 1e-5
