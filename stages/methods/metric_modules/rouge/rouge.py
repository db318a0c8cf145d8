"""ROUGE-1/2/L/Lsum (the finetune project's offline module): `rouge_score` with the Porter stemmer; each
score is the mean over examples of the per-example F-measure (the hub module's default aggregator reports
a bootstrap "mid" instead). ROUGE-Lsum splits summaries into sentences on newlines, so no sentence splitter
(nltk punkt) has to be downloaded; a prediction on one line counts as one sentence.

`n_jobs` > 1 scores the pairs with that many joblib worker processes; every pair is scored by the same
function either way, so the numbers are the same as with one."""

import datasets
import evaluate

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")

_KWARGS = """
Args:
    predictions (list of str): generated texts.
    references (list of str): reference texts, one per prediction.
    n_jobs (int): worker processes scoring the pairs (default 1).
Returns:
    rouge1, rouge2, rougeL, rougeLsum (float): mean F-measure over examples; 0.0 for no examples.
"""


class Rouge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references, n_jobs=1):
        from rouge_score import rouge_scorer

        scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
        refs, preds = list(references), list(predictions)
        if n_jobs > 1 and len(refs) > 1:
            from joblib import Parallel, delayed

            # contiguous chunks, a few per worker: one pickled scorer per chunk, not per pair
            size = -(-len(refs) // (4 * n_jobs))
            parts = Parallel(n_jobs=n_jobs)(delayed(list)(map(scorer.score, refs[i:i + size], preds[i:i + size]))
                                            for i in range(0, len(refs), size))
            scores = [s for part in parts for s in part]
        else:
            scores = [scorer.score(ref, pred) for ref, pred in zip(refs, preds, strict=True)]  # (target, prediction)
        n = max(len(scores), 1)
        return {t: sum(s[t].fmeasure for s in scores) / n for t in ROUGE_TYPES}
