"""A sweep's runs: a named sweep of pipeline.yaml (`sweeps:`) or an ad-hoc grid on the command line, expanded
into one run per variant and seed, each a base pipeline plus {dotted.key: value} overrides. Every run's config
is validated here, before anything runs (no Prefect, no tensors).

    named_sweep(NAME)                                      the named sweep
    adhoc_sweep(PIPELINE, ["train.lr=1e-4,5e-4"], ...)     the ad-hoc one `--grid train.lr=1e-4,5e-4` describes
    from_args(args, TARGET)                                either, from the options add_sweep_args defines

An ad-hoc sweep's definition is kept in its folder of the store (`sweeps/<name>/sweep.json`, with the pipeline
file it read) when it runs, so `--sweep NAME` / `finetune sweep NAME` find it later as they find a named one.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flows.reports.formatting import label
from stages.engine.cli import add_config_option
from stages.engine.commands import command
from stages.engine.config import (
    DEFAULT_PIPELINE_FILE,
    parse_override,
    pipeline_names,
    safe_yaml,
    sweep_names,
    yaml_number,
)
from stages.engine.errors import ConfigError, FinetuneError
from stages.engine.fingerprint import canonical_json, sha256_text
from stages.engine.names import inside, name_problem
from stages.engine.remote_store import open_store
from stages.engine.store import Store, write_json_atomic
from stages.graph import GRAPH
from stages.pipeline.loading import load_doc, load_pipeline, load_sweep, validate_sweep
from stages.pipeline.schema import PipelineConfig, SweepConfig


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
        variant = " ".join(f"{names[k]}={label(p[k])}" for k in keys if k in p) or cfg.pipeline
        if variant in labels:
            raise ConfigError(f"sweeps.{cfg.name}: variants {labels[variant] + 1} and {len(labels) + 1} are the same "
                              f"({variant}); remove one")
        labels[variant] = len(labels)
    runs = []
    seeds: list[int | None] = [*cfg.seeds] if cfg.seeds else [None]
    for seed in seeds:  # seed by seed: the first seed of every variant runs first
        for variant, p in zip(labels, params, strict=True):
            over = {**cfg.set, **p, **({"train.seed": seed} if seed is not None else {})}
            try:
                run_cfg = GRAPH.validate(load_pipeline(cfg.pipeline, over, config_file))  # labels, metrics, hub too
            except FinetuneError as e:
                raise ConfigError(f"sweeps.{cfg.name}, variant {variant}: {e}") from None
            runs.append(Run(variant, p, seed, over, run_cfg))
    return Sweep(cfg, runs, Path(config_file))


def named_sweep(name: str, config_file: Path | str = DEFAULT_PIPELINE_FILE) -> Sweep:
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
            values = safe_yaml(f"[{raw}]")
        except yaml.YAMLError as e:
            raise ConfigError(f"--grid {item}: values are not valid YAML ({getattr(e, 'problem', e)}); quote them") \
                from None
        except ConfigError as e:
            raise ConfigError(f"--grid {item}: {e}") from None
        grid[key.strip()] = yaml_number(values)
    return grid


def adhoc_sweep(pipeline: str, grid: list[str], sets: list[str] | None = None, seeds: list[int] | None = None,
          metric: str | None = None, mode: str | None = None, name: str | None = None,
          config_file: Path | str = DEFAULT_PIPELINE_FILE) -> Sweep:
    """The sweep `PIPELINE --grid ... [--set ...] [--seeds ...]` describes; its name (folder, UI key) is the
    pipeline and a hash of the definition unless given."""
    if name and (problem := name_problem(name)):
        raise ConfigError(f"--name: {problem}")
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


def sweep_dir(store: Store, name: str) -> Path:
    """sweeps/<name>/ of the store (of its local cache for a remote store)."""
    return inside(store.root / "sweeps", store.root / "sweeps" / name)


def save_definition(s: Sweep, store: Store) -> Path:
    """Keep an ad-hoc sweep's definition (and the pipeline file it read) in its folder of the store, its grid's
    keys in their order: `compare --sweep NAME` then orders columns and variant labels as the sweep's own
    comparison does. (A file written sorted, before this, still reads: its grid in sorted order.)"""
    path = sweep_dir(store, s.name) / "sweep.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"name": s.name, "config": str(s.config_file.resolve()), "spec": spec(s)},
                      sort_keys=False)
    return path


def stored(name: str, store: Store) -> Sweep | None:
    """The ad-hoc sweep `name` as the store keeps it (None when it never ran)."""
    path = sweep_dir(store, name) / "sweep.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return from_spec(name, saved["spec"], saved["config"], f"{path}")


def compare_hint(sw: Sweep) -> str:
    """The command that compares this sweep's variants: by its name (an ad-hoc one's definition is in the
    store), with the pipeline file it read."""
    return command("inspect", "compare", "--sweep", sw.name, config=sw.config_file)


def spec(s: Sweep) -> dict[str, Any]:
    """An ad-hoc sweep's definition as the sweep flow's `spec` parameter (JSON)."""
    return s.config.model_dump(mode="json", exclude={"name"})



def add_sweep_args(p: argparse.ArgumentParser) -> None:
    """The options that define an ad-hoc sweep (`finetune sweep`, `finetune inspect compare`)."""
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="a dotted key and its values (repeatable; the product is taken), e.g. --grid train.lr=1e-4,5e-4")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every variant of an ad-hoc sweep (repeatable)")
    p.add_argument("--seeds", type=_seeds, default=None, metavar="S1,S2", help="repeat each variant per seed "
                   "(train.seed)")
    p.add_argument("--metric", help="SPLIT.METRIC that ranks variants (default test.accuracy)")
    p.add_argument("--mode", choices=["max", "min"], help="max (default) or min")
    p.add_argument("--name", help="an ad-hoc sweep's name (its folder and UI key, `compare --sweep NAME` finds it "
                   "by); default PIPELINE-<hash of its definition>")
    add_config_option(p)


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: write integers separated by commas, e.g. 1,2,3") from None


def from_args(args: argparse.Namespace, target: str) -> Sweep:
    """A named sweep, or (with --grid/--seeds) an ad-hoc sweep of the pipeline `target`."""
    if args.grid or args.seeds:
        return adhoc_sweep(target, args.grid, args.overrides, args.seeds, args.metric, args.mode, args.name,
                           args.config)
    extra = [o for o, v in (("--set", args.overrides), ("--metric", args.metric), ("--mode", args.mode),
                            ("--name", args.name)) if v]
    if extra:
        raise ConfigError(f"{', '.join(extra)}: only for an ad-hoc sweep (PIPELINE --grid ...); a named sweep "
                          f"takes its settings from pipeline.yaml")
    names = sweep_names(args.config)
    if target in pipeline_names(args.config) and target not in names:
        raise ConfigError(f"{target} is a pipeline, not a sweep: give --grid KEY=V1,V2 to sweep it, or a sweep "
                          f"name ({', '.join(names) or 'none defined under sweeps:'})")
    if target not in names and (ran := stored(target, open_store())) is not None:
        return ran  # an ad-hoc sweep that ran before, by its name
    return named_sweep(target, args.config)
