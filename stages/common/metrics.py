"""Evaluation metrics, offline: accuracy, macro-F1 and the confusion matrix for classifiers; ROUGE-1/2/L/Lsum
for summaries, computed with `rouge_score` directly (stemming on).

Not the HF `evaluate` library: `evaluate.load("rouge")` fetches its module from the hub and fails offline,
and its default aggregator reports a bootstrap "mid" instead of the plain mean. Here each ROUGE score is
the mean over examples of the per-example F-measure. ROUGE-Lsum splits summaries into sentences on
newlines ("\\n"), so no sentence splitter (nltk punkt) has to be downloaded; a prediction on one line
counts as one sentence.
"""

from __future__ import annotations

from collections.abc import Sequence

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


# ---------------------------------------------------------------- classification


def confusion_matrix(predictions: Sequence[int], references: Sequence[int], num_labels: int) -> list[list[int]]:
    """matrix[true][predicted] = count."""
    m = [[0] * num_labels for _ in range(num_labels)]
    for p, r in zip(predictions, references, strict=True):
        m[int(r)][int(p)] += 1
    return m


def accuracy(predictions: Sequence[int], references: Sequence[int]) -> float:
    if not references:
        return 0.0
    return sum(int(p) == int(r) for p, r in zip(predictions, references, strict=True)) / len(references)


def macro_f1(predictions: Sequence[int], references: Sequence[int], num_labels: int) -> float:
    """Unweighted mean of the per-class F1 over the classes that occur in the references or predictions
    (sklearn's `f1_score(average="macro")`; a class with no true and no predicted rows is left out)."""
    return _macro_f1_of(confusion_matrix(predictions, references, num_labels))


def _macro_f1_of(m: list[list[int]]) -> float:
    """macro_f1 from a confusion matrix [true][predicted]."""
    num_labels = len(m)
    scores = []
    for c in range(num_labels):
        tp = m[c][c]
        predicted = sum(m[r][c] for r in range(num_labels))
        actual = sum(m[c])
        if predicted == 0 and actual == 0:
            continue
        scores.append(2 * tp / (predicted + actual))  # = 2PR / (P + R), 0 when tp == 0
    return sum(scores) / len(scores) if scores else 0.0


def classification_metrics(predictions: Sequence[int], references: Sequence[int], num_labels: int) -> dict:
    m = confusion_matrix(predictions, references, num_labels)
    return {
        "examples": len(references),
        "accuracy": accuracy(predictions, references),
        "macro_f1": _macro_f1_of(m),
        "confusion_matrix": m,
    }


# ---------------------------------------------------------------- summarisation


def rouge_scores(predictions: Sequence[str], references: Sequence[str]) -> list[dict[str, float]]:
    """Per-example ROUGE F-measures (rouge_score with the Porter stemmer)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    out = []
    for pred, ref in zip(predictions, references, strict=True):
        s = scorer.score(ref, pred)  # score(target, prediction)
        out.append({t: s[t].fmeasure for t in ROUGE_TYPES})
    return out


def rouge(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean F-measure over examples for ROUGE-1, -2, -L and -Lsum (0.0 for no examples)."""
    per = rouge_scores(predictions, references)
    n = max(len(per), 1)
    return {t: sum(s[t] for s in per) / n for t in ROUGE_TYPES}
