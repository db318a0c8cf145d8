"""Accuracy: the share of predictions equal to their reference (the finetune project's offline module)."""

import datasets
import evaluate

_DESCRIPTION = "Accuracy = correct predictions / examples (0.0 for no examples)."
_KWARGS = """
Args:
    predictions (list of int): predicted class ids.
    references (list of int): true class ids.
Returns:
    accuracy (float): in [0, 1].
"""


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="", inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}))

    def _compute(self, predictions, references):
        if not references:
            return {"accuracy": 0.0}
        return {"accuracy": sum(int(p) == int(r) for p, r in zip(predictions, references, strict=True))
                / len(references)}
