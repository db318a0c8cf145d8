"""A sweep's runs: a named sweep of pipeline.yaml (`sweeps:`) or an ad-hoc grid on the command line, expanded
into one run per variant and seed, each a base pipeline plus {dotted.key: value} overrides. Every run's config
is validated here, before anything runs (no Prefect, no tensors).

    sweep(NAME)                                      the named sweep
    adhoc(PIPELINE, ["train.lr=1e-4,5e-4"], ...)     the ad-hoc one `--grid train.lr=1e-4,5e-4` describes

An ad-hoc sweep's definition is kept in its folder of the store (`sweeps/<name>/sweep.json`, with the pipeline
file it read) when it runs, so `--sweep NAME` finds it later as it finds a named one.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from stages.engine.config import (
    DEFAULT_PIPELINE_FILE,
    load_doc,
    load_pipeline,
    load_sweep,
    parse_override,
    validate_sweep,
)
from stages.engine.errors import ConfigError, FinetuneError
from stages.engine.fingerprint import canonical_json, sha256_text
from stages.engine.remote_store import RemoteStore
from stages.engine.schema import PipelineConfig, SweepConfig
from stages.engine.store import Store, write_json_atomic
from stages.graph import precheck


@dataclass(frozen=True)
class Run:
    """One child run of a sweep: a variant with one seed."""

    variant: str  # the variant's label, seeds left out: "lr=0.0001 gradient_accumulation_steps=16"
    params: dict[str, Any]  # the variant's own overrides (what differs between variants), seed left out
    seed: int | None  # train.seed set by the sweep's seeds (None: the pipeline's own)
    overrides: dict[str, Any]  # everything the run sets: the sweep's `set`, the variant's params, train.seed
    cfg: PipelineConfig = field(compare=False, repr=False)

    @property
    def label(self) -> str:
        return self.variant if self.seed is None else f"{self.variant} seed={self.seed}"


@dataclass(frozen=True)
class Sweep:
    config: SweepConfig
    runs: list[Run]
    config_file: Path

    @property
    def name(self) -> str:
        return self.config.name

    def variants(self) -> list[str]:
        return list(dict.fromkeys(r.variant for r in self.runs))


def fmt(value: Any) -> str:
    """A value as it reads in a label or a table: 0.0001, 16, [test], {train: 64}."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":")).replace('"', "")
    return str(value)


def short_names(keys: list[str]) -> dict[str, str]:
    """Dotted keys by their last part where that is unambiguous: train.lr -> lr."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (n if last.count(n) == 1 else k) for k, n in zip(keys, last, strict=True)}


def variant_params(cfg: SweepConfig) -> list[dict[str, Any]]:
    if cfg.variants:
        return [dict(v) for v in cfg.variants]
    if cfg.grid:
        keys = list(cfg.grid)
        return [dict(zip(keys, values, strict=True)) for values in itertools.product(*cfg.grid.values())]
    return [{}]


def expand(cfg: SweepConfig, config_file: Path | str = DEFAULT_PIPELINE_FILE) -> Sweep:
    """Every run of the sweep, each config loaded and validated (a bad value: one ConfigError line naming the run)."""
    params = variant_params(cfg)
    keys = list(dict.fromkeys(k for p in params for k in p))
    names = short_names(keys)
    labels: dict[str, int] = {}
    for p in params:
        variant = " ".join(f"{names[k]}={fmt(p[k])}" for k in keys if k in p) or cfg.pipeline
        if variant in labels:
            raise ConfigError(f"sweeps.{cfg.name}: variants {labels[variant] + 1} and {len(labels) + 1} are the same "
                              f"({variant}); remove one")
        labels[variant] = len(labels)
    runs = []
    for seed in cfg.seeds or [None]:  # seed by seed: the first seed of every variant runs first
        for variant, p in zip(labels, params, strict=True):
            over = {**cfg.set, **p, **({"train.seed": seed} if seed is not None else {})}
            try:
                run_cfg = precheck(load_pipeline(cfg.pipeline, over, config_file))  # labels, metrics, hub too
            except FinetuneError as e:
                raise ConfigError(f"sweeps.{cfg.name}, variant {variant}: {e}") from None
            runs.append(Run(variant, p, seed, over, run_cfg))
    return Sweep(cfg, runs, Path(config_file))


def sweep(name: str, config_file: Path | str = DEFAULT_PIPELINE_FILE) -> Sweep:
    return expand(load_sweep(name, config_file), config_file)


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    """`--grid train.lr=1e-4,5e-4` (repeatable) -> {"train.lr": [1e-4, 5e-4]}. Values are YAML, as in --set:
    `--grid evaluate.splits=[test],[validation,test]`."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or not raw.strip():
            raise ConfigError(f"--grid {item}: expected KEY=V1,V2,..., e.g. --grid train.lr=1e-4,5e-4")
        try:
            values = yaml.safe_load(f"[{raw}]")
        except yaml.YAMLError as e:
            raise ConfigError(f"--grid {item}: values are not valid YAML ({getattr(e, 'problem', e)}); quote them") \
                from None
        grid[key.strip()] = [_number(v) for v in values]
    return grid


def _number(value: Any) -> Any:
    # YAML 1.1 reads 5e-5 as a string; people mean a number (as --set does)
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in "eE.") else value
        except ValueError:
            return value
    return value


def adhoc(pipeline: str, grid: list[str], sets: list[str] | None = None, seeds: list[int] | None = None,
          metric: str | None = None, mode: str | None = None, name: str | None = None,
          config_file: Path | str = DEFAULT_PIPELINE_FILE) -> Sweep:
    """The sweep `PIPELINE --grid ... [--set ...] [--seeds ...]` describes; its name (folder, UI key) is the
    pipeline and a hash of the definition unless given."""
    common = dict((".".join(parts), value) for parts, value in map(parse_override, sets or []))
    body: dict[str, Any] = {"pipeline": pipeline, "grid": parse_grid(grid), "set": common,
                            "seeds": list(seeds or [])}
    if metric:
        body["metric"] = metric
    if mode:
        body["mode"] = mode
    return from_spec(name or f"{pipeline}-{sha256_text(canonical_json(body))[:8]}", body, config_file,
                     "--grid/--set/--seeds")


def from_spec(name: str, body: dict[str, Any], config_file: Path | str = DEFAULT_PIPELINE_FILE,
              where: str = "spec") -> Sweep:
    """A sweep defined outside pipeline.yaml (the fields of a `sweeps:` entry as a mapping)."""
    doc = load_doc(Path(config_file))
    if body.get("pipeline") not in doc["pipelines"]:
        raise ConfigError(f"unknown pipeline '{body.get('pipeline')}'; available: {', '.join(doc['pipelines'])} "
                          f"(or a sweep: {', '.join(doc.get('sweeps') or {}) or 'none defined'})")
    return expand(validate_sweep(name, body, where, doc), config_file)


def sweep_dir(store: Store | RemoteStore, name: str) -> Path:
    """sweeps/<name>/ of the store (of its local cache for a remote store)."""
    local = store.local if isinstance(store, RemoteStore) else store
    return local.root / "sweeps" / name


def save_definition(s: Sweep, store: Store | RemoteStore) -> Path:
    """Keep an ad-hoc sweep's definition (and the pipeline file it read) in its folder of the store."""
    path = sweep_dir(store, s.name) / "sweep.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"name": s.name, "config": str(s.config_file.resolve()), "spec": spec(s)})
    return path


def stored(name: str, store: Store | RemoteStore) -> Sweep | None:
    """The ad-hoc sweep `name` as the store keeps it (None when it never ran)."""
    path = sweep_dir(store, name) / "sweep.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return from_spec(name, saved["spec"], saved["config"], f"{path}")


def spec(s: Sweep) -> dict[str, Any]:
    """An ad-hoc sweep's definition as the sweep flow's `spec` parameter (JSON)."""
    return s.config.model_dump(mode="json", exclude={"name"})

