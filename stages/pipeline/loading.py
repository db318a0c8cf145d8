"""pipeline.yaml read against the finetuning schema: the engine's loader (stages/engine/config.py) handed
PipelineConfig, SweepConfig and the fields that hold paths, typed for its callers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.engine import config
from stages.engine.config import DEFAULT_PIPELINE_FILE, Schema
from stages.pipeline.schema import PipelineConfig
from stages.pipeline.sweep_schema import SweepConfig

# "always": the field is a path; "local": a hub id or a path (a path when it starts with ./ ../ ~ or names
# something that exists there)
PATH_FIELDS = {("data", "path"): "always", ("data", "mirror"): "always", ("train", "accelerate_config"): "always",
               ("tokenize", "tokenizer"): "local", ("model", "name"): "local", ("evaluate", "metrics"): "local",
               ("tokenize", "chat_template"): "local"}  # a file, or an inline template (never anchored)

SCHEMA: Schema[PipelineConfig, SweepConfig] = Schema(PipelineConfig, SweepConfig, PATH_FIELDS)


def load_pipeline(name: str, overrides: list[str] | dict | None = None,
                  path: Path | str = DEFAULT_PIPELINE_FILE) -> PipelineConfig:
    """A named pipeline of pipeline.yaml (or a user's file over it), `--set` overrides applied, validated."""
    return config.load_pipeline(SCHEMA, name, overrides, path)


def load_sweep(name: str, path: Path | str = DEFAULT_PIPELINE_FILE) -> SweepConfig:
    """A named sweep of the file's `sweeps:`, validated."""
    return config.load_sweep(SCHEMA, name, path)


def validate_sweep(name: str, body: dict, where: str, doc: dict | None = None) -> SweepConfig:
    """A sweep's body (the file's, or a command line's options) -> SweepConfig, or one ConfigError naming `where`."""
    return config.validate_sweep(SCHEMA, name, body, where, doc)


def load_doc(path: Path | str = DEFAULT_PIPELINE_FILE) -> dict[str, Any]:
    """The file's pipelines, defaults and sweeps, relative paths anchored at its folder."""
    return config.load_doc(path, PATH_FIELDS)
