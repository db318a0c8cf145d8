"""The evaluate stage: offline metrics checked against independent computations, and both tiny pipelines
(a classifier head, a seq2seq summariser) run end to end on CPU through the store."""

from __future__ import annotations

import json
from pathlib import Path

import helpers
import pytest
from helpers import BILLSUM, IMDB, SHARED_DATA, needs_shared_data

from stages.methods import metrics
from stages.methods.classify import Classify
from stages.sources.arrow import read_split

BILLS = SHARED_DATA / "billsum" / "billsum_us_train_sample100.jsonl"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------- metrics, independently checked


def lead(text: str, words: int = 60) -> str:
    """A fixed, non-trivial prediction: the bill's first words, past the boilerplate title section."""
    body = text.split("SEC. 2.", 1)[-1]
    return " ".join(body.split()[:words])


@pytest.mark.skipif(not BILLS.exists(), reason="../shared/data/billsum is not beside the project")
def test_rouge_equals_an_independent_rouge_score_computation_on_100_real_bills():
    from rouge_score import rouge_scorer

    bills = read_jsonl(BILLS)
    assert len(bills) == 100
    preds = [lead(b["text"]) for b in bills]
    refs = [b["summary"] for b in bills]
    ours = metrics.rouge(preds, refs)

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    sums = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0, "rougeLsum": 0.0}
    for p, r in zip(preds, refs, strict=True):
        for k, v in scorer.score(r, p).items():
            sums[k] += v.fmeasure
    theirs = {k: v / len(bills) for k, v in sums.items()}
    diff = max(abs(ours[k] - theirs[k]) for k in theirs)
    print(f"ROUGE on 100 real bills: {ours}; max |ours - rouge_score| = {diff:.1e}")
    assert diff == 0  # the shipped evaluate module computes exactly what rouge_score's per-example mean is
    assert metrics.rouge(preds, refs, jobs=2) == ours  # scored by two joblib workers: the same numbers
    assert 0.1 < ours["rouge1"] < 0.9 and ours["rouge2"] < ours["rouge1"]  # a real, non-degenerate score


def test_rouge_lsum_splits_sentences_on_newlines_and_stems():
    ref = "The bill amends the tax code.\nIt repeals the increase."
    one_line = "it repeals the increase the bill amends the tax code"
    s = metrics.rouge([one_line], [ref])
    assert s["rougeLsum"] > s["rougeL"]  # per-sentence LCS recovers both sentences, one LCS cannot
    assert metrics.rouge(["amending taxes"], ["amends tax"])["rouge1"] == 1.0  # Porter stemming
    assert metrics.rouge([], []) == {k: 0.0 for k in metrics.ROUGE_TYPES}


def test_classification_metrics_match_sklearn():
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score

    refs = [0, 0, 1, 1, 1, 2, 2, 0, 1, 2, 2, 2]
    preds = [0, 1, 1, 1, 0, 2, 1, 0, 1, 2, 0, 2]
    m = metrics.classification_metrics(preds, refs, 3)
    assert m["accuracy"] == pytest.approx(accuracy_score(refs, preds), abs=1e-12)
    assert m["macro_f1"] == pytest.approx(f1_score(refs, preds, average="macro"), abs=1e-12)
    assert m["confusion_matrix"] == confusion_matrix(refs, preds, labels=[0, 1, 2]).tolist()
    # a class that never occurs is left out of the macro average, as sklearn does for absent labels
    assert metrics.compute(["f1"], [0, 1], [0, 1])["macro_f1"] == pytest.approx(f1_score([0, 1], [0, 1],
                                                                                          average="macro"))


# ---------------------------------------------------------------- end to end on CPU


@needs_shared_data
def test_classifier_pipeline_runs_end_to_end(store, capfd, monkeypatch):
    monkeypatch.setenv("FINETUNE_PROGRESS", "bar")  # as in a terminal (stages/engine/progress.py)
    from sklearn.metrics import f1_score

    # evaluate forced: the store is shared with the other files that use IMDB (tests/stages/conftest.py), and
    # whichever runs first computes it; its progress bar is checked below
    out = helpers.run("tiny-imdb", *IMDB, force=["evaluate"])
    assert list(out) == ["data", "tokenize", "model", "adapters", "train", "evaluate", "export"]
    ev = out["evaluate"].path
    m = json.loads((ev / "metrics.json").read_text())
    assert set(m) == {"validation", "test"}
    preds = read_jsonl(ev / "predictions.jsonl")
    for split, n in (("validation", 8), ("test", 16)):
        rows = [p for p in preds if p["split"] == split]
        ids = [str(x) for x in read_split(out["data"].path, split).column("id").to_pylist()]
        assert [r["id"] for r in rows] == ids  # every example once, in split order
        labels = read_split(out["data"].path, split).column("label").to_pylist()
        assert [r["reference_id"] for r in rows] == labels
        assert [r["reference"] for r in rows] == [["neg", "pos"][x] for x in labels]  # IMDB names its classes
        assert all(r["prediction"] == ["neg", "pos"][r["prediction_id"]] for r in rows)
        assert m[split]["examples"] == n and sum(map(sum, m[split]["confusion_matrix"])) == n
        assert m[split]["accuracy"] == pytest.approx(sum(r["prediction"] == r["reference"] for r in rows) / n)
        cm = m[split]["confusion_matrix"]
        assert [sum(row) for row in cm] == [labels.count(0), labels.count(1)]
        assert m[split]["macro_f1"] == pytest.approx(
            f1_score([r["reference"] for r in rows], [r["prediction"] for r in rows], average="macro"), abs=1e-12)
    assert out["evaluate"].manifest["metrics"]["splits"] == m
    assert "evaluate test" in capfd.readouterr().err  # the progress bar over evaluation batches
    assert out["evaluate"].manifest["metrics"]["precision"] == "no"  # the suite's CPU has no bf16 units


@needs_shared_data
def test_evaluate_runs_its_forward_passes_in_the_precision_training_used(store, monkeypatch):
    import torch

    seen = []
    real_evaluate = Classify.evaluate

    def evaluate(*a, **kw):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return real_evaluate(*a, **kw)

    monkeypatch.setattr(Classify, "evaluate", evaluate)
    out = helpers.run("tiny-imdb", *IMDB, "train.mixed_precision=bf16", until="evaluate")
    assert out["train"].manifest["metrics"]["precision"] == "bf16"
    ev = out["evaluate"].manifest["metrics"]
    assert ev["precision"] == "bf16" and "auto would choose no" in ev["precision_reason"]
    assert seen == [(True, torch.bfloat16)] * 2  # validation and test


@needs_shared_data
def test_seq2seq_pipeline_runs_end_to_end_with_rouge_on_the_real_references(store):
    out = helpers.run("tiny-billsum", *BILLSUM)
    assert list(out)[-2:] == ["evaluate", "export"]
    ev = out["evaluate"].path
    m = json.loads((ev / "metrics.json").read_text())["test"]
    rows = read_jsonl(ev / "predictions.jsonl")
    table = read_split(out["data"].path, "test")
    assert [r["id"] for r in rows] == [str(x) for x in table.column("id").to_pylist()]
    assert [r["reference"] for r in rows] == table.column("target").to_pylist()  # untruncated, original case
    assert m["examples"] == len(rows) == 20
    again = metrics.rouge([r["prediction"] for r in rows], [r["reference"] for r in rows])
    assert all(abs(m[k] - again[k]) <= 1e-12 for k in metrics.ROUGE_TYPES)
    from rouge_score import rouge_scorer  # and independently of stages.methods.metrics

    scorer = rouge_scorer.RougeScorer(list(metrics.ROUGE_TYPES), use_stemmer=True)
    scores = [scorer.score(r["reference"], r["prediction"]) for r in rows]
    assert all(abs(m[k] - sum(s[k].fmeasure for s in scores) / len(rows)) <= 1e-9 for k in metrics.ROUGE_TYPES)
    assert 1 <= m["generated_tokens_max"] <= 8
    assert all(r["prediction"] for r in rows)
    gen = out["evaluate"].manifest["metrics"]["generation"]
    assert gen == {"max_new_tokens": 8, "num_beams": 1, "do_sample": False}


@needs_shared_data
def test_beam_search_settings_reach_generation(store):
    helpers.run("tiny-billsum", *BILLSUM)
    out = helpers.run("tiny-billsum", *BILLSUM, "evaluate.num_beams=2", "evaluate.length_penalty=0.5",
                      "evaluate.max_examples=4", until="evaluate")
    assert helpers.computed(out) == {"evaluate"}
    m = json.loads((out["evaluate"].path / "metrics.json").read_text())["test"]
    assert m["examples"] == 4 and len(read_jsonl(out["evaluate"].path / "predictions.jsonl")) == 4
    gen = out["evaluate"].manifest["metrics"]["generation"]
    assert gen == {"max_new_tokens": 8, "num_beams": 2, "do_sample": False, "length_penalty": 0.5,
                   "early_stopping": True}


def test_a_split_the_data_lacks_is_an_error_naming_the_fix(tmp_path):
    from types import SimpleNamespace

    import datasets

    from stages import evaluate
    from stages.engine.errors import MissingInputError
    from stages.pipeline.schema import EvaluateConfig

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"id": ["a"], "input_ids": [[1, 2]],
                                                               "labels": [0], "length": [2]})}
                         ).save_to_disk(str(tmp_path / "dataset"))
    ctx = SimpleNamespace(cfg=SimpleNamespace(evaluate=EvaluateConfig(splits=["test"]),
                                              method=SimpleNamespace(name="classify")),
                          upstream={"tokenize": tmp_path})
    with pytest.raises(MissingInputError, match=r"evaluate.splits \['test'\].*it has train.*set evaluate.splits"):
        evaluate.run(ctx)


# ---------------------------------------------------------------- batched generation


class _Tok:
    """Just what `generate` uses of a tokenizer: the pad id and decode (1 is the end token)."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == 1))


@pytest.mark.parametrize("decoder_only", [False, True], ids=["t5-right-padded", "bloom-left-padded"])
def test_batched_generation_equals_one_at_a_time(decoder_only):
    """Padding a batch (right for encoder-decoder, left for decoder-only prompts) does not change greedy
    outputs: batch size 4 and 1 give the same texts and token counts, in the prompts' order."""
    import logging
    import random

    import torch
    from tiny_train import tiny_t5

    from stages.models.inference import generate, prompt_of

    if decoder_only:
        from transformers import BloomConfig, BloomForCausalLM

        torch.manual_seed(0)
        model = BloomForCausalLM(BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=64, pad_token_id=0,
                                             eos_token_id=1)).eval()
    else:
        model = tiny_t5().eval()
    torch.manual_seed(1)
    with torch.no_grad():  # large random weights: varied outputs (a fresh init predicts one token everywhere)
        for p in model.parameters():
            p.normal_(0, 1.0)
    rng = random.Random(3)
    prompts = [[rng.randint(2, 63) for _ in range(rng.randint(3, 17))] for _ in range(5)]
    if decoder_only:  # rows are prompt + target with the prompt's labels masked
        rows = [(p + [5, 6], [-100] * len(p) + [5, 6]) for p in prompts]
        assert [prompt_of(x, y) for x, y in rows] == prompts
    gen = {"max_new_tokens": 6, "num_beams": 1, "do_sample": False, "eos_token_id": 1, "pad_token_id": 0}
    cpu = torch.device("cpu")
    log = logging.getLogger("test")
    batched = generate(model, prompts, _Tok(), gen, 4, cpu, decoder_only, "test", log)
    single = generate(model, prompts, _Tok(), gen, 1, cpu, decoder_only, "test", log)
    assert batched == single
    assert all(1 <= n <= 6 for n in batched[1]) and len(set(batched[0])) >= 3


# ---------------------------------------------------------------- evaluate modules: today's numbers, names, paths


def todays_accuracy(predictions: list[int], references: list[int]) -> float:
    """The project's accuracy before it used `evaluate` (stages/methods/metrics.py at commit 2ed7e19)."""
    return sum(int(p) == int(r) for p, r in zip(predictions, references, strict=True)) / len(references)


def todays_macro_f1(predictions: list[int], references: list[int], num_labels: int) -> float:
    """The project's macro-F1 before it used `evaluate`: from the confusion matrix, classes present only."""
    m = [[0] * num_labels for _ in range(num_labels)]
    for p, r in zip(predictions, references, strict=True):
        m[r][p] += 1
    scores = []
    for c in range(num_labels):
        predicted, actual = sum(m[r][c] for r in range(num_labels)), sum(m[c])
        if predicted or actual:
            scores.append(2 * m[c][c] / (predicted + actual))
    return sum(scores) / len(scores)


@needs_shared_data
def test_evaluate_modules_equal_todays_metrics_on_real_imdb_predictions():
    """A fixed word rule's predictions on the 25,000 real IMDB test reviews: the shipped accuracy and f1
    modules give exactly (difference 0) the numbers of the code they replaced, and sklearn's."""
    import pandas as pd
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score

    df = pd.read_csv(SHARED_DATA / "imdb" / "test.csv.gz", keep_default_na=False)
    low = df["text"].str.lower()
    preds = ((low.str.count(r"\bgreat\b") + low.str.count(r"\bbest\b")) >
             (low.str.count(r"\bbad\b") + low.str.count(r"\bworst\b"))).astype(int).tolist()
    refs = df["label"].tolist()
    m = metrics.classification_metrics(preds, refs, 2)
    print(f"IMDB test, word rule: accuracy {m['accuracy']:.4f}, macro-F1 {m['macro_f1']:.4f}")
    assert m["accuracy"] - todays_accuracy(preds, refs) == 0
    assert m["macro_f1"] - todays_macro_f1(preds, refs, 2) == 0
    assert m["accuracy"] == pytest.approx(accuracy_score(refs, preds), abs=1e-12)
    assert m["macro_f1"] == pytest.approx(f1_score(refs, preds, average="macro"), abs=1e-12)
    assert m["confusion_matrix"] == confusion_matrix(refs, preds).tolist() and m["examples"] == 25000
    # a class nobody predicts and nobody is: left out of the average, as before
    three = metrics.classification_metrics(preds[:500], refs[:500], 3)
    assert three["macro_f1"] == todays_macro_f1(preds[:500], refs[:500], 3)


EXACT_MATCH = '''
import datasets
import evaluate


class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description="share of identical texts", citation="", inputs_description="",
                                   features=datasets.Features({"predictions": datasets.Value("string"),
                                                               "references": datasets.Value("string")}))

    def _compute(self, predictions, references):
        return {"exact_match": sum(p == r for p, r in zip(predictions, references)) / max(len(references), 1)}
'''


def test_metrics_by_name_or_path_offline(tmp_path, monkeypatch):
    """Shipped names load offline; a path loads the user's own module (its file is in the evaluate key);
    other names go to the hub, which offline is one line naming the fix; a module that cannot score the
    task's predictions is refused when the pipeline is planned."""
    from helpers import plan

    from stages.engine.errors import ConfigError, HubUnreachableError, MissingInputError
    from stages.pipeline.loading import load_pipeline

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    module = tmp_path / "exact_match"
    module.mkdir()
    (module / "exact_match.py").write_text(EXACT_MATCH)
    got = metrics.compute(["rouge", str(module)], ["the cat sat", "a dog"], ["the cat sat", "dogs bark"])
    assert got["exact_match"] == 0.5 and set(got) == {*metrics.ROUGE_TYPES, "exact_match"}

    def evaluate_key() -> str:
        items = plan(load_pipeline("tiny-billsum", [f"evaluate.metrics=[rouge, {module}]"]))
        return next(i.key.key for i in items if i.stage.name == "evaluate")

    before = evaluate_key()
    (module / "exact_match.py").write_text(EXACT_MATCH.replace("share of identical", "identical"))
    assert evaluate_key() != before

    with pytest.raises(HubUnreachableError, match=r"^evaluate.metrics bleu: the hub is off .* list the project's "
                                                  r"offline modules \(accuracy, f1, rouge, exact_match\)"):
        metrics.load("bleu")
    with pytest.raises(MissingInputError, match="evaluate.metrics ./nowhere/exact_match: no such file or folder"):
        metrics.module_path("./nowhere/exact_match")
    with pytest.raises(ConfigError, match="evaluate.metrics rouge: scores texts, but method classify predicts "
                                          "labels; use accuracy, f1"):
        plan(load_pipeline("tiny-imdb", ["evaluate.metrics=[rouge]"]))
