"""Exact match of short generated answers (the finetune project's offline module): each prediction,
normalised, its first words (as many as its reference has) against the normalised reference."""

import re
import string

import datasets
import evaluate

_DESCRIPTION = ("Exact match = examples whose normalised prediction starts with the normalised reference, word "
                "for word / examples (0.0 for no examples). Normalised: lowercased, punctuation removed, "
                "whitespace collapsed and stripped. Only the prediction's first N words count, N the reference's "
                "word count, so 'Positive. The review praises...' matches 'positive'.")
_KWARGS = """
Args:
    predictions (list of str): generated texts.
    references (list of str): the expected answers.
Returns:
    exact_match (float): in [0, 1].
"""
_PUNCTUATION = re.compile(f"[{re.escape(string.punctuation)}]")


def normalise(text: str) -> list[str]:
    """The words of `text`, lowercased, its punctuation removed (SQuAD's normalisation: "don't" is "dont")."""
    return _PUNCTUATION.sub("", text.lower()).split()


def matches(prediction: str, reference: str) -> bool:
    want = normalise(reference)
    return normalise(prediction)[:len(want)] == want


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
