"""Macro-F1 (the finetune project's offline module): the unweighted mean of the per-class F1 over the
classes that occur in the references or the predictions, as sklearn's `f1_score(average="macro")` (a class
with no true and no predicted rows is left out). Reported as `macro_f1`."""

import datasets
import evaluate

_KWARGS = """
Args:
    predictions (list of int): predicted class ids.
    references (list of int): true class ids.
Returns:
    macro_f1 (float): in [0, 1]; 0.0 for no examples.
"""


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}))

    def _compute(self, predictions, references):
        classes = sorted({int(x) for x in predictions} | {int(x) for x in references})
        scores = []
        for c in classes:  # in class-id order
            tp = sum(int(p) == c and int(r) == c for p, r in zip(predictions, references, strict=True))
            predicted = sum(int(p) == c for p in predictions)
            actual = sum(int(r) == c for r in references)
            scores.append(2 * tp / (predicted + actual))  # = 2PR / (P + R), 0 when tp == 0
        return {"macro_f1": sum(scores) / len(scores) if scores else 0.0}
