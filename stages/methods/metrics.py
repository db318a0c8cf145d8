"""Evaluation metrics through the `evaluate` library: `evaluate.metrics` in pipeline.yaml names modules,
each by name or path, and `compute` runs them.

The project ships its own offline modules (stages/methods/metric_modules: accuracy, f1 = macro-F1, rouge =
ROUGE-1/2/L/Lsum with `rouge_score`, exact_match = a short
answer's first words against the reference), loaded by path, so nothing is fetched: `evaluate.load("rouge")` would
fetch the hub's script and fails offline, and its aggregator reports a bootstrap "mid" instead of the plain
mean. A path names a local `evaluate` module (a folder holding NAME.py, or the .py file); any other name
is an `evaluate` module on the Hugging Face hub, loaded only when the hub answers. The files of the shipped
and local modules are inputs of the evaluate stage, so editing one reruns it.

The confusion matrix [true][predicted] stays here: it is a table, not an `evaluate` score.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stages.engine.errors import ConfigError, MissingInputError
from stages.engine.parallel import n_jobs
from stages.sources.hub import ensure_hub_reachable, hub_answers

MODULES_DIR = Path(__file__).resolve().parent / "metric_modules"
SHIPPED = {"accuracy": "labels", "f1": "labels", "rouge": "texts", "exact_match": "texts"}  # what each scores: class ids or texts
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
# the module that computes each validation metric during training (a method's validation_metrics; loss and
# accuracy are counted by the validation pass itself)
VALIDATION_MODULES = {"macro_f1": "f1", "exact_match": "exact_match", **{r: "rouge" for r in ROUGE_TYPES}}
PARALLEL_MIN_PAIRS = 500  # fewer ROUGE pairs are scored in this process (starting workers costs ~1 s)


def metric_names(configured: Sequence[str] | None, method: Any) -> list[str]:
    """`evaluate.metrics`, or the method's default (`method`: its Method, stages/methods/base.py); a shipped
    module that cannot score this method's predictions is a ConfigError (class ids for classify, texts for
    generation)."""
    names = list(configured) if configured else list(method.default_metrics)
    want = method.predicts
    for name in names:
        kind = SHIPPED.get(name)
        if kind is not None and kind != want:
            fits = [n for n, k in SHIPPED.items() if k == want]
            raise ConfigError(f"evaluate.metrics {name}: scores {kind}, but method {method.name} predicts {want}; "
                              f"use {', '.join(fits)} (or a module that scores {want})")
    return names


def module_path(name: str) -> Path | None:
    """The folder or file of a shipped or local module; None for a hub module name."""
    if name in SHIPPED:
        return MODULES_DIR / name
    path = Path(name).expanduser()
    if path.exists():
        return path.resolve()
    if name.startswith(("/", "./", "../", "~")) or name.endswith(".py"):
        raise MissingInputError(f"evaluate.metrics {name}: no such file or folder; give the path of a local "
                                f"`evaluate` module (a folder holding NAME.py, or the .py file)")
    return None


def module_files(names: Sequence[str]) -> list[Path]:
    """The shipped and local modules' files and folders (their content goes into the stage's key). A hub
    module's name is refused here, at plan, when the hub does not answer (a misspelt offline name)."""
    paths = [module_path(n) for n in names]
    hub = [n for n, p in zip(names, paths, strict=True) if p is None]
    if hub and not hub_answers():
        name = hub[0]
        close = difflib.get_close_matches(name, list(SHIPPED), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"evaluate.metrics {name}: not one of the project's offline modules ({', '.join(SHIPPED)}) "
                          f"nor a local path, and the hub that would serve it does not answer; {hint}list offline "
                          f"modules or the path of a local `evaluate` module")
    return [p for p in paths if p is not None]


def validation_metric_files(cfg: Any) -> list[Path]:
    """The train stage's input files: the module select_best's metric is computed with during training
    (val_macro_f1, val_rouge*), its content in the key as in the evaluate stage's."""
    sb = cfg.train.select_best
    module = VALIDATION_MODULES.get(sb.metric.removeprefix("val_")) if sb is not None else None
    return module_files([module]) if module else []


def load(name: str) -> Any:
    """The `evaluate` module `name`: shipped or local by path, else from the hub (checked first)."""
    import evaluate

    path = module_path(name)
    if path is None:
        ensure_hub_reachable(f"evaluate.metrics {name}", "list the project's offline modules (accuracy, f1, rouge, exact_match) "
                             "or the path of a local `evaluate` module")
        return evaluate.load(name, keep_in_memory=True)
    return evaluate.load(str(path), keep_in_memory=True)


def compute(names: Sequence[str], predictions: Sequence[Any], references: Sequence[Any], *,
            jobs: int | None = None) -> dict[str, Any]:
    """Every module's results, merged in order. The shipped rouge scores many pairs with joblib workers
    (`jobs`, default: the available cores); its numbers are the same with one."""
    out: dict[str, Any] = {}
    for name in names:
        kw: dict[str, Any] = {}
        if name == "rouge":
            kw["n_jobs"] = n_jobs(jobs) if len(predictions) >= PARALLEL_MIN_PAIRS or jobs else 1
        out.update(load(name).compute(predictions=list(predictions), references=list(references), **kw))
    return out


def confusion_matrix(predictions: Sequence[int], references: Sequence[int], num_labels: int) -> list[list[int]]:
    """matrix[true][predicted] = count."""
    m = [[0] * num_labels for _ in range(num_labels)]
    for p, r in zip(predictions, references, strict=True):
        m[int(r)][int(p)] += 1
    return m


def classification_metrics(predictions: Sequence[int], references: Sequence[int], num_labels: int,
                           names: Sequence[str] = ("accuracy", "f1")) -> dict[str, Any]:
    """examples, the modules' scores (default accuracy and macro_f1), the confusion matrix."""
    return {"examples": len(references), **compute(names, predictions, references),
            "confusion_matrix": confusion_matrix(predictions, references, num_labels)}


def rouge(predictions: Sequence[str], references: Sequence[str], *, jobs: int | None = None) -> dict[str, float]:
    """Mean F-measure over examples for ROUGE-1, -2, -L and -Lsum (0.0 for no examples)."""
    return compute(["rouge"], predictions, references, jobs=jobs)


def metric_files(cfg: Any, method: Any) -> list[Path]:
    """The evaluate stage's input files: the `evaluate` modules it loads by path for `method` (a wrong metric
    fails here, at plan)."""
    return module_files(metric_names(cfg.evaluate.metrics, method))
