"""What the store holds for a pipeline, without running anything (no Prefect either): each stage's
current key and whether it is `cached`, `stale` (an artifact of an earlier config, code or library
exists, and we say which input changed, in `dvc status` words) or `missing`; and `gc`, which finds the
artifacts that no pipeline's current keys, no result a user ran and no live run reach.

The baseline a stale stage is compared with is the artifact the pipeline last used (refs/<pipeline>.json),
else the newest artifact of that stage made by the same pipeline.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from stages.engine.config import DEFAULT_PIPELINE_FILE, load_pipeline, pipeline_names
from stages.engine.errors import ConfigError, FinetuneError, MissingInputError, StoreUnavailableError
from stages.engine.fingerprint import UNRESOLVED
from stages.engine.plan import Graph, Plan, Planned
from stages.engine.results import Result, read_results
from stages.engine.store import GC_LOCK, TMP_NAME, Lookup, StageKey, Store, folder_size

CACHED, STALE, MISSING = "cached", "stale", "missing"
# A stage that resumes (train) keeps {"step": N, "of": M} here in its scratch folder, for `status` to say
# "resumable from step N of M" without knowing the stage's checkpoint format.
RESUME_FILE = "resume.json"

MAX_HEADLINE = 4  # metrics shown in the status table, the first found of the stage's `Stage.headline`


@dataclass
class StageStatus:
    stage: str
    key: str  # the key the current config gives this stage
    status: str  # cached / stale / missing
    reasons: list[str] = field(default_factory=list)  # why stale or missing, dvc-style
    path: str | None = None  # the artifact shown: the current one, else the stale baseline
    artifact_key: str | None = None  # key of that artifact (== key when cached)
    size_bytes: int | None = None
    created: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)  # headline metrics
    resumable: dict[str, int] | None = None  # {"step", "of"}: a stopped run of this key left a checkpoint

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------- diffs


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1e-4}} -> {'train.lr': 1e-4}; an empty mapping is a value."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def changed_params(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted config fields whose value differs: {'tokenize': {'max_length': 8}} vs 16 -> tokenize.max_length."""
    a, b = flatten(old, ""), flatten(new, "")
    return sorted(k for k in a.keys() | b.keys() if a.get(k, _ABSENT) != b.get(k, _ABSENT))


_ABSENT = object()


def _changed_files(old: dict[str, str], new: dict[str, str]) -> list[str]:
    out = []
    for name in sorted(old.keys() | new.keys()):
        if name not in old:
            out.append(f"{name} (new)")
        elif name not in new:
            out.append(f"{name} (deleted)")
        elif old[name] != new[name] and name.startswith("hub "):  # a hub revision that moved
            out.append(f"{name} {old[name][:7]} -> {new[name][:7]}")
        elif old[name] != new[name]:
            out.append(f"{name} (modified)")
    return out


def _objects(entries: list[str]) -> dict[str, str]:
    """["module.qualname:sha12", ...] -> {name: sha12} (older manifests list bare names)."""
    return {e.rpartition(":")[0] if ":" in e else e: e.rpartition(":")[2] if ":" in e else "" for e in entries}


def why_changed(old_inputs: dict[str, Any], sk: StageKey) -> list[str]:
    """What differs between an artifact's recorded key inputs and the current StageKey, as
    `changed params: train.lr`, `changed upstream: tokenize`, `changed deps: ...`, `changed code`,
    `changed libraries: torch 2.3.0 -> 2.4.0`."""
    new = {**sk.key_inputs(), "code_objects": list(sk.code_objects)}
    out = []
    if params := changed_params(old_inputs.get("params") or {}, new["params"]):
        out.append("changed params: " + ", ".join(params))
    old_up, new_up = old_inputs.get("upstream") or {}, new["upstream"]
    if ups := sorted(n for n in old_up.keys() | new_up.keys() if old_up.get(n) != new_up.get(n)):
        out.append("changed upstream: " + ", ".join(ups))
    if deps := _changed_files(old_inputs.get("inputs") or {}, new["inputs"]):
        out.append("changed deps: " + ", ".join(deps))
    if old_inputs.get("code") != new["code"]:
        old_objs, new_objs = _objects(old_inputs.get("code_objects") or []), _objects(new["code_objects"])
        detail = ([f"{o} (modified)" for o in sorted(old_objs.keys() & new_objs.keys())
                   if old_objs[o] != new_objs[o]]
                  + [f"+{o}" for o in sorted(new_objs.keys() - old_objs.keys())]
                  + [f"-{o}" for o in sorted(old_objs.keys() - new_objs.keys())])
        out.append("changed code" + (f": {', '.join(detail)}" if detail else f" (the {sk.stage} stage's functions)"))
    old_lib, new_lib = old_inputs.get("libraries") or {}, new["libraries"]
    if libs := [f"{n} {old_lib.get(n, 'absent')} -> {new_lib.get(n, 'absent')}"
                for n in sorted(old_lib.keys() | new_lib.keys()) if old_lib.get(n) != new_lib.get(n)]:
        out.append("changed libraries: " + ", ".join(libs))
    if old_inputs.get("stage", sk.stage) != sk.stage:
        out.append(f"changed stage: {old_inputs.get('stage')}")
    return out or ["changed key (no recorded input differs; manifest from an older store format?)"]


# ---------------------------------------------------------------- status


def headline(metrics: dict[str, Any] | None, wanted: tuple[str, ...]) -> dict[str, Any]:
    """A few scalar metrics worth a table column: the first found of `wanted` (a stage's `Stage.headline`, in
    its order, each by name or dotted suffix); a list of records counts its last (train's validation history)."""
    if not isinstance(metrics, dict):
        return {}
    flat: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, list) and v and isinstance(v[-1], dict):  # e.g. train's validation history
            v = v[-1]
        if isinstance(v, dict):
            for k2, v2 in flatten(v, k).items():
                flat[k2] = v2
        else:
            flat[k] = v
    scalars = {k: v for k, v in flat.items() if isinstance(v, int | float | str) and not isinstance(v, bool)}
    numbers = {k: v for k, v in scalars.items() if not isinstance(v, str)}
    out: dict[str, Any] = {}
    for want in wanted:
        hits = [k for k in numbers if k == want] or [k for k in numbers if k.endswith("." + want)]
        hits.sort(key=lambda k: k.startswith("baseline."))  # the tuned model's before evaluate.baseline's
        if hits and hits[0] not in out:
            out[hits[0]] = numbers[hits[0]]
        if len(out) >= MAX_HEADLINE:
            break
    return out


def _artifact_facts(store: Store, item: Planned, key: str) -> dict[str, Any]:
    stage = item.name
    m = store.read_manifest(stage, key) or {}
    return {"path": store.location(stage, key), "artifact_key": key,
            "size_bytes": sum(f.get("size", 0) for f in m.get("files", [])),
            "created": m.get("finished_at"), "metrics": headline(m.get("metrics"), item.stage.headline)}


def _baseline(store: Store, pipeline: str, stage: str, current: str) -> str | None:
    """The key of the artifact to compare a non-cached stage with."""
    ref = store.refs(pipeline).get(stage)
    if ref and ref != current and store.read_manifest(stage, ref) is not None:
        return ref
    best: tuple[str, str] | None = None
    for st, key, _ in store.entries():
        if st != stage or key == current:
            continue
        m = store.read_manifest(stage, key)
        if m and m.get("pipeline") == pipeline and m.get("key_inputs"):
            stamp = m.get("finished_at") or ""
            if best is None or stamp > best[0]:
                best = (stamp, key)
    return best[1] if best else None


def lookups(plan: Plan, store: Store) -> dict[str, Lookup]:
    """The hit rule (Store.lookup) for every stage of the plan, as a run would meet it: each stage checked
    against its upstream artifacts' content digests where those are hits. Where an upstream is not a hit
    it is computed first, and its new content is unknown until then: the stage is judged on its own files
    and, when they pass, its hit is conditional (`why` names the upstreams): the run reuses it when they
    come out as recorded (a deterministic stage does), and recomputes it otherwise."""
    out: dict[str, Lookup] = {}
    for item in plan.items:
        ups = {u: (out[u].manifest or {}).get("digest") if out[u].hit else None for u in item.stage.upstream}
        found = store.lookup(item.key, ups, plan.verify)
        pending = [u for u in item.stage.upstream if not out[u].hit or out[u].why != CACHED]
        if found.hit and pending:
            found = Lookup(True, f"cached if {' and '.join(pending)} (computed first) comes out as recorded; "
                                 "recomputed otherwise", found.manifest)
        out[item.name] = found
    return out


def stage_status(store: Store, pipeline: str, item: Planned, found: Lookup) -> StageStatus:
    sk = item.key
    st = StageStatus(stage=sk.stage, key=sk.key, status=MISSING)
    if found.hit:
        st.status = CACHED
        if found.why != CACHED:
            st.reasons = [found.why]
        for k, v in _artifact_facts(store, item, sk.key).items():
            setattr(st, k, v)
        return st
    if found.manifest is not None:  # its own artifact, made from upstream content that has since changed
        st.status = STALE
        st.reasons = [f"changed upstream content: {found.why}; the next run recomputes it under the same key"]
        for k, v in _artifact_facts(store, item, sk.key).items():
            setattr(st, k, v)
        return st
    corrupt = found.why != "not in store"
    problems = [found.why]
    base = _baseline(store, pipeline, sk.stage, sk.key)
    if base is not None:
        manifest = store.read_manifest(sk.stage, base) or {}
        st.status = STALE
        st.reasons = why_changed(manifest.get("key_inputs") or {}, sk)
        for k, v in _artifact_facts(store, item, base).items():
            setattr(st, k, v)
    else:
        st.reasons = ["not in cache"]
    if corrupt:
        st.reasons.append(f"current artifact invalid: {'; '.join(problems)}")
    st.resumable = resume_point(store.work_dir(sk.stage, sk.key))
    if st.resumable:
        st.reasons.append(f"resumable from step {st.resumable['step']} of {st.resumable['of']} (a stopped run's "
                          "checkpoint; the next run continues from it)")
    return st


def resume_point(work_dir: Path) -> dict[str, int] | None:
    try:
        note = json.loads((work_dir / RESUME_FILE).read_text())
        return {"step": int(note["step"]), "of": int(note["of"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def pipeline_status(plan: Plan, store: Store) -> list[StageStatus]:
    found = lookups(plan, store)
    return [stage_status(store, plan.cfg.name, item, found[item.name]) for item in plan.items]


def find(statuses: list[StageStatus], stage: str) -> StageStatus:
    for s in statuses:
        if s.stage == stage:
            return s
    raise ConfigError(f"unknown stage '{stage}'; stages are {', '.join(s.stage for s in statuses)}")


# ---------------------------------------------------------------- gc


@dataclass
class Garbage:
    kind: str  # artifact / work / tmp
    stage: str
    key: str
    path: str
    size_bytes: int
    removed: bool = False
    note: str = ""
    young: bool = False  # inside gc's grace period: listed, never removed
    group: str = ""  # what it belonged to: `sweep NAME` / `pipeline NAME` (a dropped result, or its manifest's)


@dataclass
class Kept:
    """One reason gc keeps artifacts: a pipeline's current config in the file, what a pipeline last ran
    (refs/), a result (results/: a run as the file has it, a --set variant, a sweep's child), live runs."""

    group: str  # `pipeline NAME`, `sweep NAME`, `live runs`
    what: str  # `current config`, `last run`, a result's --set list, `running`
    drop: str | None  # the `gc --drop` argument that forgets it (None: kept while the file or the run has it)
    keys: set[tuple[str, str]] = field(default_factory=set)
    updated: str | None = None  # a result's: when it last recorded a key
    held: dict[tuple[str, str], int] = field(default_factory=dict)  # of `keys`, the store's valid artifacts: bytes

    @property
    def size_bytes(self) -> int:
        return sum(self.held.values())

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "what": self.what, "drop": self.drop, "updated": self.updated,
                "artifacts": len(self.held), "size_bytes": self.size_bytes}


def current_keys(store: Store, graph: Graph, pipelines_file: Path | str = DEFAULT_PIPELINE_FILE,
                 invalid: dict[tuple[str, str], str] | None = None) -> list[Kept]:
    """(stage, key) of every stage of every pipeline in the file, for its current config. A pipeline
    that cannot be planned stops gc: deleting what it might reach would be a guess. `invalid` collects the
    reachable artifacts the hit rule rejects on their own files (corrupt, a malformed manifest): the next
    run recomputes them whatever gc does. One made from changed upstream content stays reachable until the
    next run replaces it (status shows it stale)."""
    out = []
    for name in pipeline_names(Path(pipelines_file)):
        try:
            if graph.project is None:
                raise ConfigError("gc: the graph has no project to load pipelines with")
            plan = graph.plan(load_pipeline(graph.project.schema, name, None, pipelines_file), store, pinned=False)
            items = plan.items
        except FinetuneError as e:
            raise ConfigError(f"gc: cannot compute pipeline {name}'s keys ({e}); fix it first, nothing removed") \
                from None
        keep = {(i.key.stage, i.key.key) for i in items}
        if invalid is not None:
            found = lookups(plan, store)
            invalid.update({(i.key.stage, i.key.key): found[i.name].why for i in items
                            if not found[i.name].hit and found[i.name].manifest is None
                            and found[i.name].why != "not in store"})
        # a hub revision this machine cannot resolve: the stage's current key is unknown, keep what it made
        unknown = {i.key.stage for i in items if UNRESOLVED in i.key.inputs.values()}
        if unknown:
            keep |= {(stage, key) for stage, key, _ in store.entries() if stage in unknown
                     and (store.read_manifest(stage, key) or {}).get("pipeline") == name}
        out.append(Kept(f"pipeline {name}", "current config", None, keep))
    return out


@dataclass
class Forgotten:
    """What a gc forgets on purpose: results and refs named by --drop or older than --older-than."""

    results: list[Result] = field(default_factory=list)
    refs: dict[str, dict[str, str]] = field(default_factory=dict)  # pipeline -> its refs (read before dropping)
    why: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)  # (stage, key) -> (group, why)


def forgotten(store: Store, results: list[Result], drop: list[str], cutoff: datetime | None) -> Forgotten:
    """The results and refs `--drop NAME` names (a sweep: its children; a pipeline: its last run and its own
    results, --set variants included, not its sweeps'; NAME@ID: one result), and the results that last
    recorded a key before `cutoff` (--older-than)."""
    refs = store.ref_names()
    sweeps = {r.sweep for r in results if r.sweep}
    pipelines = set(refs) | {r.pipeline for r in results if not r.sweep}
    if unknown := [n for n in drop if n not in sweeps | pipelines | {r.handle for r in results}]:
        raise ConfigError(f"--drop {unknown[0]}: no sweep, pipeline or result of that name on store {store} "
                          f"(sweeps: {', '.join(sorted(sweeps)) or 'none'}; pipelines: "
                          f"{', '.join(sorted(pipelines)) or 'none'}; a result's NAME@ID is in gc's dry run)")
    out = Forgotten()
    for r in results:
        named = r.sweep in drop or (not r.sweep and r.pipeline in drop) or r.handle in drop
        if named or (cutoff is not None and _before(r.updated, cutoff)):
            out.results.append(r)
            for sk in r.keys.items():
                out.why.setdefault(sk, (r.group, "dropped" if named else "older than --older-than"))
    for name in refs:
        if name in drop:
            out.refs[name] = store.refs(name)
            for sk in out.refs[name].items():
                out.why.setdefault(sk, (f"pipeline {name}", "dropped"))
    return out


def last_runs(store: Store, results: list[Result], gone: Forgotten, cutoff: datetime | None) -> list[Kept]:
    """What each pipeline last ran (refs/) that no result records: runs from before results were recorded,
    or one stopped between a commit and its record (a result, dropped or not, decides for its own keys).
    With `cutoff`, only what was committed since."""
    recorded = {sk for r in results for sk in r.keys.items()}
    out = []
    for name in store.ref_names():
        if name in gone.refs:
            continue
        keys = set(store.refs(name).items()) - recorded
        if cutoff is not None:
            keys = {sk for sk in keys if not _before(_finished(store, *sk), cutoff)}
        if keys:
            out.append(Kept(f"pipeline {name}", "last run (no result recorded)", name, keys))
    return out


def _finished(store: Store, stage: str, key: str) -> str:
    return str((store.read_manifest(stage, key) or {}).get("finished_at") or "")


def _before(stamp: str | None, cutoff: datetime) -> bool:
    """Whether an ISO time is before cutoff. No time at all (a ref none of whose artifacts is left: nothing
    to keep) is; one that does not parse is not (kept)."""
    if not stamp:
        return True
    try:
        when = datetime.fromisoformat(stamp)
    except ValueError:
        return False
    return (when if when.tzinfo else when.replace(tzinfo=UTC)) < cutoff


def find_garbage(store: Store, keep: set[tuple[str, str]], invalid: dict[tuple[str, str], str] | None = None) \
        -> list[Garbage]:
    """Unreachable artifacts, reachable ones the hit rule rejects (`invalid`), and the scratch (.work: this
    machine's, and on a shared store what runs published there) of unreachable keys that no live run
    holds (`keep` has the live runs' keys; a reachable key's scratch is a stopped run's checkpoint, which
    the next run resumes from: kept)."""
    invalid = invalid or {}
    out = [Garbage("artifact", stage, key, store.location(stage, key), store.size(stage, key),
                   note=f"invalid ({invalid[stage, key]}); the next run recomputes it" if (stage, key) in invalid else "")
           for stage, key, _ in store.entries() if (stage, key) not in keep or (stage, key) in invalid]
    out += [Garbage("work", stage, key, location, size)
            for stage, key, location, size in store.work_entries() if (stage, key) not in keep]
    out += [Garbage("tmp", m.group("stage") if (m := TMP_NAME.fullmatch(d.name)) else "-",
                    m.group("key") if m else d.name, str(d), folder_size(d),
                    note="a dead run's temporary folder") for d in store.dead_tmp()]
    return out


def remove_garbage(store: Store, garbage: list[Garbage]) -> list[Garbage]:
    """Delete each item unless a run holds its key's lock (then it is in use: kept)."""
    for g in garbage:
        if g.kind == "tmp" or g.young:
            continue
        try:
            g.removed = store.remove(g.stage, g.key) if g.kind == "artifact" else store.remove_work(g.stage, g.key)
        except OSError as e:
            g.note = f"not removed: {e}"
            continue
        if g.removed:
            store.log_event(event="gc", stage=g.stage, key=g.key, kind=g.kind, size_bytes=g.size_bytes)
        else:
            g.note = "in use by a running stage; kept"
    tmp = [g for g in garbage if g.kind == "tmp"]
    if tmp:
        store.sweep_tmp()
        for g in tmp:
            g.removed = not Path(g.path).exists()
    return garbage


def gc(store: Store, graph: Graph, pipelines_file: Path | str = DEFAULT_PIPELINE_FILE, *, force: bool = False,
       keep_refs: bool = True, min_age_s: float = 0.0, drop: Iterable[str] = (), older_than_s: float | None = None,
       kept: list[Kept] | None = None) -> list[Garbage]:
    """Unreachable or invalid artifacts and work (removed with `force`). Reachable: the current keys of the
    file's pipelines and (keep_refs) every result (stages/engine/results.py: each variant a user ran, each
    child of a sweep) and what a pipeline last ran that no result records (`last_runs`), until it is dropped
    on purpose (`drop`, `older_than_s`: see `forgotten`; with `force` those records and refs are removed
    first). Under the store-wide gc lock: a run registers its plan under that lock, so every key a live run
    reads or writes is kept, and one that starts during the sweep waits for it. Artifacts committed and work
    written less than `min_age_s` ago are kept. `kept` receives what keeps the rest, with the store's
    artifacts and bytes."""
    if not store.exists():
        raise MissingInputError(f"store {store} does not exist; set FINETUNE_STORE or run a pipeline first")
    if (why := store.unwritable()) is not None:  # a dry run only lists: it reads the store and takes no lock
        if force:
            raise StoreUnavailableError(f"inspect gc --force: the store {store} cannot be written: {why}; nothing "
                                        f"was removed. Run it as a user who can write the store")
        store.read_only = True
    invalid: dict[tuple[str, str], str] = {}
    sources = current_keys(store, graph, pipelines_file, invalid)  # a pipeline that cannot be planned stops gc here
    cutoff = None if older_than_s is None else datetime.now(UTC) - timedelta(seconds=older_than_s)
    with contextlib.nullcontext() if store.read_only else store.lock(GC_LOCK, "gc"):
        # the live runs first: one that ends after this wrote its results and refs before it ended
        live = store.live_keys()
        results = read_results(store)
        gone = forgotten(store, results, list(drop), cutoff)
        if keep_refs:
            dropped = {r.id for r in gone.results}
            sources += [Kept(r.group, r.label, r.handle, set(r.keys.items()), r.updated)
                        for r in results if r.id not in dropped]
            sources += last_runs(store, results, gone, cutoff)
        if live:
            sources.append(Kept("live runs", "running", None, live))
        if force:
            for name in gone.refs:
                store.drop_ref(name)
            for r in gone.results:
                store.drop_result(r.id)
        garbage = find_garbage(store, set().union(*(k.keys for k in sources)), invalid)
        for g in garbage:
            if _young(store, g, min_age_s):
                g.young, g.note = True, f"newer than {min_age_s / 60:g} min; kept (--min-age)"
            _attribute(store, g, gone)
        out = remove_garbage(store, garbage) if force else garbage
    if kept is not None:
        kept.extend(sized(store, sources, set(invalid)))
    return out


def _attribute(store: Store, g: Garbage, gone: Forgotten) -> None:
    """Name what an item belonged to: the dropped result or ref that kept it, else its manifest's pipeline."""
    if g.kind == "tmp":
        g.group = "dead runs (.tmp)"
    elif (g.stage, g.key) in gone.why:
        g.group, why = gone.why[g.stage, g.key]
        g.note = g.note or why
    elif g.kind == "artifact" and (pipeline := (store.read_manifest(g.stage, g.key) or {}).get("pipeline")):
        g.group = f"pipeline {pipeline}"
    else:
        g.group = "stopped runs' scratch (.work)" if g.kind == "work" else "no pipeline recorded"


def sized(store: Store, sources: list[Kept], invalid: set[tuple[str, str]]) -> list[Kept]:
    """Each source with the sizes of the valid artifacts of its keys that the store holds."""
    present = {(s, k) for s, k, _ in store.entries()} - invalid
    sizes: dict[tuple[str, str], int] = {}
    for k in sources:
        for sk in sorted(k.keys & present):
            if sk not in sizes:
                sizes[sk] = store.size(*sk)
            k.held[sk] = sizes[sk]
    return sources


def _young(store: Store, g: Garbage, min_age_s: float) -> bool:
    """Committed (an artifact) or last written (work) less than min_age_s ago."""
    if min_age_s <= 0 or g.kind == "tmp":
        return False
    if g.kind == "artifact":
        finished = (store.read_manifest(g.stage, g.key) or {}).get("finished_at")
        try:
            return finished is not None and \
                (datetime.now(UTC) - datetime.fromisoformat(finished)).total_seconds() < min_age_s
        except (TypeError, ValueError):
            return False
    try:
        return time.time() - Path(g.path).stat().st_mtime < min_age_s
    except OSError:
        return False
