"""Runs a pipeline's stages through the store. The stage graph is handed in (`graph`: the stages in
order, see stages/graph.py); the engine never names a stage. The Prefect flow calls the same
`run_pipeline`, running each stage's `run_stage` in a task."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.engine.errors import ConfigError, MissingInputError
from stages.engine.fingerprint import (
    OUTPUT_LIBRARIES,
    PROCESS_MEMO,
    HashMemo,
    inputs_digest,
    library_versions,
    remembered_code_fingerprint,
)
from stages.engine.schema import PipelineConfig
from stages.engine.store import Outcome, StageKey, Store

log = logging.getLogger("finetune")


class Lazy:
    """A function named by module and name, imported at its first call. The graph names the stage bodies
    (and their prechecks) this way, so that planning, and a run where every stage is a store hit, never
    import the libraries the bodies compute with (torch, transformers). The code fingerprint finds its
    source by the same names (root_of)."""

    def __init__(self, module: str, name: str):
        self.__module__, self.__qualname__ = module, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(self.__module__), self.__qualname__)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Lazy({self.__module__}.{self.__qualname__})"


@dataclass(frozen=True)
class Stage:
    """A stage: its body, the config fields it reads (dotted paths: its key covers exactly these),
    the stages it consumes, and the files it reads directly."""

    name: str
    body: Callable[[StageContext], dict[str, Any] | None]
    reads: tuple[str, ...]
    upstream: tuple[str, ...] = ()
    inputs: Callable[[PipelineConfig], list[Path]] = field(default=lambda cfg: [])
    # Hub repos it downloads, each pinned to the commit its revision points at: {"hub repo@rev": sha}
    deps: Callable[[PipelineConfig], dict[str, str]] = field(default=lambda cfg: {})
    libraries: tuple[str, ...] = OUTPUT_LIBRARIES
    # Runs on the whole config before the body when the stage is about to compute; it may stop the run
    # (e.g. the memory estimate) but does not change outputs, so it stays out of the key.
    precheck: Callable[[PipelineConfig], Any] | None = None
    # Fills config fields the pipeline left to be derived from the inputs (e.g. the data stage's label
    # names, which size the model's head) before any key is computed, so every key covers the values used.
    resolve: Callable[[PipelineConfig], PipelineConfig] | None = None


class ConfigView:
    """The part of the config a stage declared in `reads`; anything else raises, so a key can never
    miss a field the stage uses."""

    def __init__(self, obj: Any, reads: tuple[str, ...], stage: str, prefix: str = ""):
        self._obj, self._reads, self._stage, self._prefix = obj, reads, stage, prefix

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        path = f"{self._prefix}{name}"
        if any(path == r or path.startswith(r + ".") for r in self._reads):
            return getattr(self._obj, name)
        if any(r.startswith(path + ".") for r in self._reads):
            return ConfigView(getattr(self._obj, name), self._reads, self._stage, path + ".")
        raise AttributeError(f"stage '{self._stage}' reads config '{path}' but does not declare it in its "
                             f"reads; add it to the stage's reads in stages/graph.py")


@dataclass
class StageContext:
    cfg: Any  # a ConfigView over PipelineConfig
    out_dir: Path  # everything written here becomes the artifact (committed atomically)
    work_dir: Path  # scratch that survives a crash of this key (checkpoints); deleted after commit
    upstream: dict[str, Path]
    upstream_manifests: dict[str, dict[str, Any]]
    log: logging.Logger


def select(cfg: PipelineConfig, path: str) -> Any:
    value: Any = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return value.cache_dict() if hasattr(value, "cache_dict") else value


@dataclass(frozen=True)
class Planned:
    stage: Stage
    key: StageKey


def code_roots(st: Stage) -> list[Any]:
    """Where a stage's code fingerprint starts: its body, the function that picks its input files, and
    the engine objects a body calls into (the config view it reads through, its context, Lazy)."""
    return [st.body, st.inputs, st.deps, ConfigView, StageContext, Lazy]


def plan(cfg: PipelineConfig, graph: Iterable[Stage], hashes: HashMemo | None = None) -> list[Planned]:
    """Keys for every stage, computed up front (a key needs only upstream keys, not their outputs).
    `hashes`: the store's memo of input-file hashes (default: this process's)."""
    cfg = resolve_config(cfg, graph)
    keys: dict[str, StageKey] = {}
    out = []
    hashes = hashes or PROCESS_MEMO
    for st in graph:
        code, objects = remembered_code_fingerprint(code_roots(st), hashes)
        sk = StageKey(
            stage=st.name,
            params={r: select(cfg, r) for r in st.reads},
            upstream={u: keys[u].key for u in st.upstream},
            inputs={**inputs_digest(st.inputs(cfg), hashes), **st.deps(cfg)},
            code=code,
            code_objects=tuple(objects),
            libraries=library_versions(st.libraries),
        )
        keys[st.name] = sk
        out.append(Planned(st, sk))
    return out


def resolve_config(cfg: PipelineConfig, graph: Iterable[Stage]) -> PipelineConfig:
    """The config with every stage's derived fields filled in (Stage.resolve; idempotent)."""
    for st in graph:
        if st.resolve is not None:
            cfg = st.resolve(cfg)
    return cfg


def stage_names(graph: Iterable[Stage]) -> list[str]:
    return [s.name for s in graph]


def check_stage_names(graph: Iterable[Stage], names: Iterable[str], option: str) -> None:
    valid = stage_names(graph)
    for n in names:
        if n not in valid:
            raise ConfigError(f"{option} {n}: unknown stage; stages are {', '.join(valid)}")


def check_run_options(graph: Iterable[Stage], force: Iterable[str] = (), only: str | None = None,
                      until: str | None = None) -> None:
    """Refuse an unknown stage name in --force / --only / --until (ConfigError, one line)."""
    check_stage_names(graph, force, "--force")
    if only:
        check_stage_names(graph, [only], "--only")
    if until:
        check_stage_names(graph, [until], "--until")


def run_stage(cfg: PipelineConfig, item: Planned, store: Store, done: dict[str, Outcome], *,
              force: bool = False, verify: bool = False) -> Outcome:
    """Run (or reuse) one stage. `done` holds the outcomes of its upstream stages."""
    st, sk = item.stage, item.key
    missing = [u for u in st.upstream if u not in done]
    if missing:
        raise MissingInputError(f"stage {st.name}: upstream {', '.join(missing)} has not run; run the pipeline "
                                f"without --only first")
    ups = {u: done[u] for u in st.upstream}
    ctx_factory = lambda out, work: StageContext(  # noqa: E731
        cfg=ConfigView(cfg, st.reads, st.name), out_dir=out, work_dir=work,
        upstream={u: o.path for u, o in ups.items()},
        upstream_manifests={u: o.manifest for u, o in ups.items()},
        log=logging.getLogger(f"finetune.{st.name}"))
    if st.precheck and not force and store.problems(sk.stage, sk.key):
        st.precheck(cfg)
    outcome = store.run(
        sk, lambda out, work: st.body(ctx_factory(out, work)), pipeline=cfg.name,
        config={r: select(cfg, r) for r in st.reads},
        upstream_digests={u: o.manifest["digest"] for u, o in ups.items()},
        force=force, verify=verify)
    store.set_ref(cfg.name, st.name, sk.key)
    return outcome


def cached_outcome(store: Store, item: Planned, done: dict[str, Outcome], verify: bool = False) -> Outcome | None:
    """The stage's committed artifact if the store has a valid one made from these upstream outcomes
    (`done`), else None. Through `Store.cached`, so a remote store downloads it into its local cache."""
    sk = item.key
    manifest, _ = store.cached(sk, {u: done[u].manifest["digest"] for u in item.stage.upstream}, verify)
    if manifest is None:
        return None
    return Outcome(sk.stage, sk.key, store.artifact_dir(sk.stage, sk.key), False, "cached", manifest)


def upstream_for_only(items: list[Planned], only: str, store: Store, verify: bool = False) -> dict[str, Outcome]:
    """For --only STAGE: its upstream stages' committed artifacts, which must already be in the store."""
    done: dict[str, Outcome] = {}
    ancestors = _ancestors(items, only)
    for item in items:  # in pipeline order: a stage's upstream is in `done` before the stage
        name = item.stage.name
        if name in ancestors:
            hit = cached_outcome(store, item, done, verify)
            if hit is None:
                raise MissingInputError(f"--only {only}: upstream stage {name} is not in the store for this "
                                        f"config; run the whole pipeline first")
            done[name] = hit
    return done


RunStage = Callable[..., Outcome]  # run_stage's signature: (cfg, item, store, done, *, force, verify)


def run_pipeline(cfg: PipelineConfig, store: Store, graph: Iterable[Stage], *, only: str | None = None, until: str | None = None,
                 force: Iterable[str] = (), verify: bool = False,
                 on_outcome: Callable[[Outcome], None] | None = None, run: RunStage = run_stage) -> list[Outcome]:
    """Run the stages `only` / `until` select, each through `run` (default run_stage; the Prefect flow
    passes one that runs the stage's task). Unknown stage names are a ConfigError before anything runs."""
    force = set(force)
    check_run_options(graph, force, only, until)
    cfg = resolve_config(cfg, graph)  # the stages run on the config their keys were computed from
    items = plan(cfg, graph, store.hashes())
    done = upstream_for_only(items, only, store, verify) if only else {}
    results = []
    for item in to_run(items, only, until):
        name = item.stage.name
        outcome = run(cfg, item, store, done, force=name in force, verify=verify)
        done[name] = outcome
        results.append(outcome)
        if on_outcome:
            on_outcome(outcome)
    return results


def to_run(items: list[Planned], only: str | None, until: str | None) -> list[Planned]:
    """The stages a run executes: just `only`, or everything up to and including `until`."""
    if only:
        return [i for i in items if i.stage.name == only]
    names = [i.stage.name for i in items]
    return items[: names.index(until) + 1] if until in names else items


def _ancestors(items: list[Planned], name: str) -> set[str]:
    by_name = {i.stage.name: i.stage for i in items}
    out: set[str] = set()
    todo = list(by_name[name].upstream)
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(by_name[n].upstream)
    return out
