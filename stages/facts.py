"""What the reports (flows/) read of a run's stages. A report finds a stage by what it is for (its `role`, set
in stages/graph.py), never by its name, so a pipeline whose graph differs (a method's extra stage, a stage
renamed) keeps its reports; and it reads the stage's manifest metrics through the typed view of that role."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypedDict, cast

from stages.engine.stage import Stage

# The kind of a history record of an optimizer step (with its `loss`), as the training stage writes it
STEP_RECORD = "train"

# The roles (Stage.role)
LOADS_MODEL = "loads the model"  # the base model as loaded: ModelMetrics
MAKES_TRAINABLE = "makes it trainable"  # adapters or a full finetune: AdapterMetrics
TRAINS = "trains"  # its `history` file holds the loss curve: TrainMetrics
EVALUATES = "evaluates"  # EvaluateMetrics
SHIPS = "ships the model"  # the exported model a run produced (produces_model): ExportMetrics


class ModelMetrics(TypedDict, total=False):
    model_class: str
    quantization: str
    parameters: int
    footprint_bytes: int


class AdapterMetrics(TypedDict, total=False):
    method: str  # lora or full
    trainable: int
    total: int
    percent: float
    lora_targets: list[str]
    footprint_bytes: int


class TrainMetrics(TypedDict, total=False):
    examples: int
    steps: int
    effective_batch: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    first_loss: float
    final_loss: float
    tokens_per_s: float
    train_seconds: float
    validation: list[dict[str, Any]]  # one record per validation, the last the latest
    best: dict[str, Any]  # train.select_best: {metric, value, step}
    stopped: str


class EvaluateMetrics(TypedDict, total=False):
    splits: dict[str, dict[str, Any]]  # {split: {metric: value}}
    baseline: dict[str, dict[str, Any]]  # evaluate.baseline: the untuned model's, per split


class ExportMetrics(TypedDict, total=False):
    command: str  # the command that reproduces it
    method: str
    layout: str
    format: str  # exports made before `layout` was named
    merged: bool
    onnx: dict[str, Any]  # written beside the model (export.formats)
    gguf: dict[str, Any]


def stage_named(stages: Iterable[Stage[Any]], role: str) -> str | None:
    """The name of the stage with this role, None when the graph has none."""
    return next((s.name for s in stages if s.role == role), None)


def role_of(stages: Iterable[Stage[Any]], name: str) -> str | None:
    return next((s.role for s in stages if s.name == name), None)


def metrics_of(stages: Iterable[Stage[Any]], role: str, manifests: Mapping[str, Mapping[str, Any] | None]) \
        -> dict[str, Any]:
    """The manifest metrics of the stage with this role, from {stage: manifest}; {} when it has none."""
    name = stage_named(stages, role)
    manifest = manifests.get(name) if name is not None else None
    found = (manifest or {}).get("metrics")
    return found if isinstance(found, dict) else {}


def model_metrics(stages: Iterable[Stage[Any]], manifests: Mapping[str, Mapping[str, Any] | None]) -> ModelMetrics:
    return cast(ModelMetrics, metrics_of(stages, LOADS_MODEL, manifests))


def adapter_metrics(stages: Iterable[Stage[Any]], manifests: Mapping[str, Mapping[str, Any] | None]) \
        -> AdapterMetrics:
    return cast(AdapterMetrics, metrics_of(stages, MAKES_TRAINABLE, manifests))


def train_metrics(stages: Iterable[Stage[Any]], manifests: Mapping[str, Mapping[str, Any] | None]) -> TrainMetrics:
    return cast(TrainMetrics, metrics_of(stages, TRAINS, manifests))


def evaluate_metrics(stages: Iterable[Stage[Any]], manifests: Mapping[str, Mapping[str, Any] | None]) \
        -> EvaluateMetrics:
    return cast(EvaluateMetrics, metrics_of(stages, EVALUATES, manifests))


def export_metrics(stages: Iterable[Stage[Any]], manifests: Mapping[str, Mapping[str, Any] | None]) -> ExportMetrics:
    return cast(ExportMetrics, metrics_of(stages, SHIPS, manifests))
