"""Exact match of short generated answers (the finetune project's offline module): the prediction and the
reference normalised (lowercase, punctuation dropped, whitespace collapsed), then the prediction's first words,
as many as the reference has, compared with the reference. "Positive." and "positive, clearly" both match the
reference "positive"; "This review is positive" does not (it did not answer as asked)."""

import re

import datasets
import evaluate

_DESCRIPTION = "Exact match = predictions whose first words equal the reference, after normalising both."
_KWARGS = """
Args:
    predictions (list of str): generated answers.
    references (list of str): reference answers.
Returns:
    exact_match (float): in [0, 1].
"""


def normalise(text):
    return re.sub(r"[^\w\s]", " ", text.lower()).split()


def matches(prediction, reference):
    ref = normalise(reference)
    return normalise(prediction)[:len(ref)] == ref


class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="", inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references):
        if not references:
            return {"exact_match": 0.0}
        return {"exact_match": sum(matches(p, r) for p, r in zip(predictions, references, strict=True))
                / len(references)}
