"""A pipeline's plan: the stage graph validated once (`Graph`), and for one config every stage's key and
what a run does with it (`Plan`). `Graph.plan` is the one place a run is prepared: it resolves what is
resolved per run (the stages' derived fields: labels, precision, compute dtype; input-file hashes; hub
revisions, each once), checks everything that can be checked without running a stage (one FinetuneError,
before the store is written), and computes the keys. `python -m stages` and the Prefect flow both execute
the plan it returns (stages/engine/runner.py); `--only`, `--until` and `--force` are operations on it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

from stages.engine.commands import command
from stages.engine.config import Schema, load_pipeline
from stages.engine.errors import ConfigError, FinetuneError, HubUnreachableError
from stages.engine.fingerprint import (
    PROCESS_MEMO,
    UNRESOLVED,
    HashMemo,
    inputs_digest,
    library_versions,
    remembered_code_fingerprint,
)
from stages.engine.hooks import Hook
from stages.engine.stage import Stage, code_roots, stage_params
from stages.engine.store import StageKey

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Sequence

    from stages.engine.store import Store

# What a run does with a planned stage:
RUN = "run"  # reuse its artifact when the store has a hit, else compute it
FORCE = "force"  # compute it, without looking in the store first (--force)
READ = "read"  # an upstream of --only: read from the store, which must have it


# ---------------------------------------------------------------- what the engine is handed about a project
# A graph carries its project (stages/graph.py builds the finetuning one): the config its pipelines are validated
# against, what a run checks beyond the stages' own checks, the hooks every run carries (Kedro's
# before/after_node_run, on_node_error) and what a command line's options turn on. So the engine names no section
# of the config, no method and no metric.

class Pipeline(Protocol):
    """What the engine reads of a pipeline's config; every other field is the stages'."""

    @property
    def name(self) -> str: ...

    @property
    def overrides(self) -> list[str]: ...

    @property
    def config_file(self) -> str | None: ...

    def overrides_within(self, reads: tuple[str, ...]) -> list[str]: ...


def _nothing(_: Any) -> None:
    return None


@dataclass(frozen=True)
class Project:
    """A graph's pipelines: their schema; `check_run`, called on a resolved config at plan time for a run (not
    for a report such as status), may refuse it in one ConfigError; `hooks` makes the hooks of one run;
    `options` applies a command line's options to this process (before its config loads)."""

    schema: Schema[Any, Any]
    check_run: Callable[[Any], None] = _nothing
    hooks: Callable[[], Sequence[Hook]] = tuple
    options: Callable[[argparse.Namespace], None] = _nothing


# ---------------------------------------------------------------- the graph and its plans

class GraphError(FinetuneError):
    """The stage graph itself is wrong (a stage's upstream misspelled or listed after it)."""


P = TypeVar("P", bound=Pipeline)  # the config of the graph's pipelines (its project's schema)


class Graph(Generic[P]):
    """The stages in run order, validated when built: names unique, every upstream an earlier stage; and
    the project whose pipelines run them (their schema, run checks and hooks)."""

    def __init__(self, stages: Iterable[Stage[P]], project: Project | None = None):
        self.stages: tuple[Stage[P], ...] = tuple(stages)
        self.project = project
        self.names: list[str] = [s.name for s in self.stages]
        seen: set[str] = set()
        for st in self.stages:
            if st.name in seen:
                raise GraphError(f"stage {st.name}: declared twice")
            for up in st.upstream:
                if up not in self.names:
                    raise GraphError(f"stage {st.name}: upstream '{up}' is not a stage{_did_you_mean(up, self.names)}; "
                                     f"stages are {', '.join(self.names)}")
                if up not in seen:
                    raise GraphError(f"stage {st.name}: upstream '{up}' comes after it; list {up} before {st.name}")
            seen.add(st.name)
        self._by_name = {s.name: s for s in self.stages}
        self.selectable: list[str] = self.names  # what --only / --until / --force may name

    def __iter__(self) -> Iterator[Stage[P]]:
        return iter(self.stages)

    def __getitem__(self, name: str) -> Stage[P]:
        return self._by_name[name]

    def ancestors(self, name: str) -> set[str]:
        out: set[str] = set()
        todo = list(self[name].upstream)
        while todo:
            n = todo.pop()
            if n not in out:
                out.add(n)
                todo.extend(self[n].upstream)
        return out

    def check_selection(self, force: Iterable[str] = (), only: str | None = None, until: str | None = None) -> None:
        """Refuse an unknown stage name in --force / --only / --until (ConfigError, one line)."""
        for option, names in (("--force", list(force)), ("--only", [only] if only else []),
                              ("--until", [until] if until else [])):
            for n in names:
                if n not in self.selectable:
                    raise ConfigError(f"{option} {n}: unknown stage{_did_you_mean(n, self.selectable)}; stages are "
                                      f"{', '.join(self.selectable)}")

    def load(self, args: argparse.Namespace) -> P:
        """The config a command line names (pipeline, --set, --config), its stage options checked, the
        project's options applied to this process (`--track`: tracking on here and in what it starts)."""
        if self.project is None:
            raise GraphError("this graph has no project: build it with Graph(stages, Project(schema, ...)) to load "
                             "a pipeline through it")
        self.project.options(args)
        self.check_selection(getattr(args, "force", ()), getattr(args, "only", None), getattr(args, "until", None))
        return cast(P, load_pipeline(self.project.schema, args.pipeline, args.overrides, args.config))

    def validate(self, cfg: P, only: str | None = None, until: str | None = None) -> P:
        """Every check `plan` makes, without hashing anything: the resolved config (a sweep checks each
        variant this way before its first run starts)."""
        return self._checked(cfg, only, until, True)[0]

    def plan(self, cfg: P, store: Store | None = None, *, only: str | None = None,
             until: str | None = None, force: Iterable[str] = (), verify: bool = False,
             hashes: HashMemo | None = None, pinned: bool = True) -> Plan[P]:
        """Resolve, check and key `cfg` for every stage, then select (--only / --until) and force. Input
        files are hashed through the store's memo (`store`, else `hashes`, else this process's); nothing is
        written before every check has passed. `pinned=False` (a report: status, diff, gc): a hub revision
        this machine cannot resolve stays `unresolved` in its key instead of stopping the plan."""
        force = tuple(force)
        self.check_selection(force, only, until)
        cfg, files, deps = self._checked(cfg, only, until, pinned)
        memo = store.hashes() if store is not None else hashes or PROCESS_MEMO
        keys: dict[str, StageKey] = {}
        items = []
        for st in self.stages:
            code, objects = remembered_code_fingerprint(code_roots(st))
            keys[st.name] = StageKey(
                stage=st.name, params=stage_params(cfg, st.reads), upstream={u: keys[u].key for u in st.upstream},
                inputs={**inputs_digest(files[st.name], memo), **deps[st.name]}, code=code,
                code_objects=tuple(objects), libraries=library_versions(st.libraries))
            items.append(Planned(st, keys[st.name]))
        return Plan(cfg, self, tuple(items), verify).select(only, until).forcing(force)

    def _checked(self, cfg: P, only: str | None, until: str | None, pinned: bool) \
            -> tuple[P, dict[str, list[Path] | dict[str, Path]], dict[str, dict[str, str]]]:
        """Everything that can be known before a run, checked without touching the store: the stage options,
        the stages' derived fields and the data they read (Stage.resolve), each stage's config checks
        (Stage.check), the project's run checks (for a run: tracking that is on can work), every input file
        the stages name, and that each hub repo the selected stages download can be pinned (each revision resolved once). Raises one FinetuneError; returns the resolved config
        and each stage's input files and hub pins."""
        self.check_selection((), only, until)
        for st in self.stages:
            if st.resolve is not None:
                cfg = st.resolve(cfg)
        for st in self.stages:
            if st.check is not None:
                st.check(cfg)
        if pinned and self.project is not None:  # a run, not a report
            self.project.check_run(cfg)
        files = {st.name: st.inputs(cfg) for st in self.stages}  # a wrong path raises here, for every stage
        deps = {st.name: st.deps(cfg) for st in self.stages}
        chosen = [only] if only else self.names[: self.names.index(until) + 1] if until else self.names
        needed = set(chosen) | {a for n in chosen for a in self.ancestors(n)}
        for st in self.stages:
            for dep, sha in deps[st.name].items():
                if pinned and st.name in needed and sha == UNRESOLVED:
                    repo = dep.removeprefix("hub ")
                    raise HubUnreachableError(f"stage {st.name}: {repo} is on the Hugging Face hub, which does not "
                                              f"answer (or HF_HUB_OFFLINE is set), and not in its local cache; "
                                              f"{st.hub_fix}")
        return cfg, files, deps


def _did_you_mean(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


@dataclass(frozen=True)
class Planned:
    """A stage, its key for this config, and what the run does with it (RUN, FORCE or READ)."""

    stage: Stage[Any]
    key: StageKey
    action: str = RUN

    @property
    def name(self) -> str:
        return self.stage.name


@dataclass(frozen=True)
class Plan(Generic[P]):
    """One config's stages with their keys, in run order, and what a run does with each: immutable;
    `select` and `forcing` return new plans."""

    cfg: P  # resolved: the config every key was computed from
    graph: Graph[P]
    items: tuple[Planned, ...]
    verify: bool = False  # check the full sha256 of every reused artifact

    def __getitem__(self, stage: str) -> Planned:
        for item in self.items:
            if item.name == stage:
                return item
        raise ConfigError(f"unknown stage '{stage}'; stages are {', '.join(i.name for i in self.items)}")

    @property
    def steps(self) -> tuple[Planned, ...]:
        """The stages a run executes, in order (READ ones are only looked up)."""
        return tuple(i for i in self.items if i.action != READ)

    @property
    def reads(self) -> tuple[Planned, ...]:
        return tuple(i for i in self.items if i.action == READ)

    def select(self, only: str | None = None, until: str | None = None) -> Plan[P]:
        """Just `only` (its upstream read from the store), or every stage up to and including `until`."""
        self.graph.check_selection((), only, until)
        if only:
            ancestors = self.graph.ancestors(only)
            items = tuple(replace(i, action=READ) if i.name in ancestors else i
                          for i in self.items if i.name == only or i.name in ancestors)
        elif until:
            names = [i.name for i in self.items]
            items = self.items[: names.index(until) + 1]
        else:
            items = self.items
        return replace(self, items=items)

    def forcing(self, names: Iterable[str]) -> Plan[P]:
        """The named stages computed even if the store has them (a READ stage stays read)."""
        names = set(names)
        self.graph.check_selection(names)
        return replace(self, items=tuple(replace(i, action=FORCE) if i.name in names and i.action == RUN else i
                                         for i in self.items))

    def selection(self) -> dict[str, object]:
        """--only / --until / --force as the run history records them."""
        steps = [i.name for i in self.steps]
        only = steps[0] if self.reads and len(steps) == 1 else None
        until = steps[-1] if not only and steps and steps[-1] != self.graph.names[-1] else None
        return {"only": only, "until": until, "force": sorted(i.name for i in self.items if i.action == FORCE)}

    def run_command(self) -> str:
        """The command that runs this config's whole pipeline, as it was loaded (file and --set list)."""
        return command("run", self.cfg.name, config=self.cfg.config_file, overrides=self.cfg.overrides)
