"""What a stage is (`Stage`: its body, the config fields it reads, its upstream, its input files) and what
its body is handed (`StageContext`, whose config is a `ConfigView` of exactly the fields it declared). The
stage graph (stages/graph.py) is a list of these; the engine never names a stage."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from stages.engine.fingerprint import OUTPUT_LIBRARIES

C = TypeVar("C")  # a pipeline's config, as the graph's project validates it (stages/engine/plan.py Project)

JOINED = "joined"  # the reason of a joined stage's Outcome: no artifact here, the pipeline stops after it


class Lazy:
    """A function named by module and name, imported at its first call. The graph names the stage bodies
    (and their prechecks) this way, so that planning, and a run where every stage is a store hit, never
    import the libraries the bodies compute with (torch, transformers). The code fingerprint finds its
    source by the same names (root_of)."""

    def __init__(self, module: str, name: str):
        self.__module__, self.__qualname__ = module, name

    def load(self) -> Callable[..., Any]:
        """The function itself (imported now)."""
        return cast(Callable[..., Any], getattr(importlib.import_module(self.__module__), self.__qualname__))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Lazy({self.__module__}.{self.__qualname__})"


def loaded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A Lazy's function, imported; any other callable as it is."""
    return fn.load() if isinstance(fn, Lazy) else fn


@dataclass(frozen=True)
class Stage(Generic[C]):
    """A stage: its body, the config fields it reads (dotted paths: its key covers exactly these),
    the stages it consumes, and the files it reads directly."""

    name: str
    body: Callable[[StageContext[C]], dict[str, Any] | None]
    reads: tuple[str, ...]
    upstream: tuple[str, ...] = ()
    # a list of paths, or {name: path} to key a file by that name instead of its folder's
    inputs: Callable[[C], list[Path] | dict[str, Path]] = field(default=lambda cfg: [])
    # Hub repos it downloads, each pinned to the commit its revision points at: {"hub repo@rev": sha}
    deps: Callable[[C], dict[str, str]] = field(default=lambda cfg: {})
    libraries: tuple[str, ...] = OUTPUT_LIBRARIES
    # Runs on the whole config before the body when the stage is about to compute; it may stop the run
    # (e.g. the memory estimate) but does not change outputs, so it stays out of the key.
    precheck: Callable[[C], Any] | None = None
    # Fills config fields the pipeline left to be derived from the inputs (e.g. the data stage's label
    # names, which size the model's head) before any key is computed, so every key covers the values used.
    resolve: Callable[[C], C] | None = None
    # Checks the config for this stage at plan time (after `resolve`), before any stage runs: raises one
    # ConfigError naming the field and the fix. Never changes the config, so it stays out of the key.
    check: Callable[[C], None] | None = None
    # How to run without the hub, for the one line that refuses a run whose hub repo cannot be pinned.
    hub_fix: str = "use a local copy (a folder, a file or pkg:PACKAGE/PATH) or run where the hub answers"
    # Says (a line, else None) when this run only takes part in a computation another machine commits
    # (a training across machines, on machine_rank > 0): the body then runs in a scratch folder outside
    # the store - no lease, nothing committed - and the pipeline stops after it.
    joins: Callable[[C], str | None] | None = None
    # Its metrics are among a run's headline numbers (the run history, `inspect runs`).
    reports: bool = False
    # The dotted manifest metrics (`rows.train`, `final_loss`) that `inspect status` shows beside its key.
    headline: tuple[str, ...] = ()
    # What reports find the stage by (the graph's project names the roles: stages/facts.py), so that no
    # report names a stage; None: no report reads it on its own.
    role: str | None = None
    # Files of its artifact (fnmatch patterns) that record how a computation went (timings, event files
    # named by time and pid), which no downstream stage reads: verified like the others, but out of the
    # artifact's digest, so a retrain that reproduces its weights leaves the stages after it cached.
    volatile: tuple[str, ...] = ()
    # Experiment tracking (stages/pipeline/tracking.py; never in a key): a JSON-lines file of its artifact whose
    # records with a `step` are step metrics, the files (fnmatch patterns) logged as the run's artifacts, and
    # whether its artifact is the model the run produced (linked from the run).
    history: str | None = None
    tracked: tuple[str, ...] = ()
    produces_model: bool = False
    # More code it runs than its body reaches by name (functions, classes, or (module, name) pairs): the
    # pipeline's method, which the graph looks up by name (stages/graph.py). Its fingerprint is in the key.
    code: tuple[Any, ...] = ()


class ConfigView:
    """The part of the config a stage declared in `reads`; anything else raises, so a key can never
    miss a field the stage uses."""

    def __init__(self, obj: Any, reads: tuple[str, ...], stage: str, prefix: str = ""):
        self._obj, self._reads, self._stage, self._prefix = obj, reads, stage, prefix

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        path = f"{self._prefix}{name}"
        if path == "overrides" and path in self._reads:
            return self._obj.overrides_within(self._reads)
        if any(path == r or path.startswith(r + ".") for r in self._reads):
            return getattr(self._obj, name)
        if any(r.startswith(path + ".") for r in self._reads):
            return ConfigView(getattr(self._obj, name), self._reads, self._stage, path + ".")
        fields = getattr(type(self._obj), "model_fields", {})
        if name not in fields and hasattr(type(self._obj), name) and not callable(getattr(type(self._obj), name)):
            return getattr(self._obj, name)  # a constant of the section's class (a method's head), not a setting
        raise AttributeError(f"stage '{self._stage}' reads config '{path}' but does not declare it in its "
                             f"reads; add it to the stage's reads in stages/graph.py")


@dataclass
class StageContext(Generic[C]):
    """What a stage body is handed. `cfg` is typed as the config it reads (`StageContext[PipelineConfig]`:
    `ctx.cfg.train.lr` is TrainConfig.lr to a reader and a type checker); at run time it is a ConfigView
    over it."""

    cfg: C
    out_dir: Path  # everything written here becomes the artifact (committed atomically)
    work_dir: Path  # scratch that survives a crash of this key (checkpoints); deleted after commit
    upstream: dict[str, Path]
    upstream_manifests: dict[str, dict[str, Any]]
    log: logging.Logger


def stage_params(cfg: Any, reads: tuple[str, ...]) -> dict[str, Any]:
    """The values of the config fields a stage reads, as its key records them (`overrides`: those of the
    fields it reads, as ConfigView shows them)."""
    return {r: cfg.overrides_within(reads) if r == "overrides" else select(cfg, r) for r in reads}


def select(cfg: Any, path: str) -> Any:
    value: Any = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return value.cache_dict() if hasattr(value, "cache_dict") else value


def code_roots(st: Stage[Any]) -> list[Any]:
    """Where a stage's code fingerprint starts: its body, the function that picks its input files, and
    the engine objects a body calls into (the config view it reads through, its context, Lazy)."""
    return [st.body, st.inputs, st.deps, ConfigView, StageContext, Lazy, *st.code]
