"""The stage store: artifacts keyed by what their stage reads (params, upstream keys, input-file content,
code fingerprint, library versions; stages/engine/plan.py), each with a manifest of its files' sizes and
sha256 and a digest over them.

Layout under the root (default `artifacts/`):
  <stage>/<key>/           a committed artifact: the stage's files plus manifest.json
  .tmp/<stage>-<key>-...   work in progress; never read, removed by the next writer of that key
  .locks/<key>.lock        one flock per key: two runs never compute the same key at once
  .work/<stage>-<key>/     a stage's scratch that survives a crash (training checkpoints), so a
                           rerun of the same key resumes; removed once the artifact is committed
  refs/<pipeline>.json     the keys a pipeline last used, per stage (for status and gc)
  results/<id>.json        a variant a user ran (pipeline, --set list, sweep) and its keys: gc keeps them
  events.jsonl             one line per stage outcome (computed / cached / recomputed and why)

A stage is written to .tmp, its files hashed into manifest.json (written last), and the folder renamed
into place: a reader sees all of it or none of it.

The hit rule, `Store.lookup`, is the one every command asks (run, `inspect status`, `diff`, `summary`, gc):
an artifact is a hit when (1) its manifest is valid (the `Manifest` schema) and names its own key, (2) every
file has the recorded size (and sha256, with verify=True), and (3) each upstream artifact it was made from
still has the content digest the manifest recorded. Anything else is a miss with its reason, never a crash:
a run warns and recomputes. A key is the same whenever its inputs are, so under (3) a recompute replaces
the artifact under the same key; the new manifest records the digest it replaces and why (`replaces`), and
events.jsonl has the line, so one key never names two contents unrecorded.

`Store` holds the one skeleton (cached -> lock -> compute -> commit -> publish). A shared store on an
fsspec URL (`remote_store.RemoteStore`) is the same class with its reads pointed at the URL and its hooks
overridden: `fetch_upstream` (download what a computing stage reads; a hit downloads nothing),
`materialize` (an artifact's folder a command asks for), `publish` (upload a commit) and `try_lock` (a lease).
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from stages.engine.errors import ConfigError, CorruptArtifactError, store_failure
from stages.engine.fingerprint import HashMemo, canonical_json, file_sha256, sha256_text
from stages.engine.names import name_problem
from stages.engine.stage import loaded

log = logging.getLogger("finetune.store")
MANIFEST = "manifest.json"
GC_LOCK = "gc"  # the store-wide lock: gc's sweep, a run's registration
RESULTS = "results"  # results/<id>.json: what gc keeps until dropped (stages/engine/results.py)
TMP_NAME = re.compile(r"(?P<stage>\w+)-(?P<key>[0-9a-f]{64})-\d+-[0-9a-f]{8}")  # .tmp/<stage>-<key>-<pid>-<id>


@dataclass(frozen=True)
class StageKey:
    """Everything a stage's output depends on, and the sha256 over it."""

    stage: str
    params: dict[str, Any]
    upstream: dict[str, str]
    inputs: dict[str, str]
    code: str
    code_objects: tuple[str, ...]
    libraries: dict[str, str]
    key: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", sha256_text(canonical_json(self.key_inputs())))

    def key_inputs(self) -> dict[str, Any]:
        return {"stage": self.stage, "params": self.params, "upstream": self.upstream,
                "inputs": self.inputs, "code": self.code, "libraries": self.libraries}


@dataclass(frozen=True)
class Outcome:
    stage: str
    key: str
    path: Path
    computed: bool
    reason: str
    manifest: dict[str, Any]


class ManifestFile(BaseModel):
    path: str
    size: int
    sha256: str


class UpstreamRef(BaseModel):
    key: str
    digest: str | None


class Manifest(BaseModel):
    """What the store relies on in a manifest.json (the rest: config, key inputs, times... is for people)."""

    model_config = ConfigDict(extra="allow")
    key: str
    stage: str
    files: list[ManifestFile]
    digest: str
    upstream: dict[str, UpstreamRef]
    duration_s: float
    metrics: dict[str, Any]


def manifest_problems(manifest: Any, stage: str, key: str) -> list[str]:
    """Why a parsed manifest cannot describe artifact stage/key ([] when it can)."""
    try:
        m = Manifest.model_validate(manifest)
    except ValidationError as e:
        err = e.errors()[0]
        return [f"manifest.json malformed: {'.'.join(map(str, err['loc'])) or 'top level'}: {err['msg']}"]
    if m.key != key or m.stage != stage:
        return ["manifest belongs to another key"]
    return []


@dataclass(frozen=True)
class Lookup:
    """The hit rule's answer for one key: a hit, or why not (`manifest`: the artifact's, when it parses)."""

    hit: bool
    why: str
    manifest: dict[str, Any] | None = None


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any, sort_keys: bool = True) -> None:
    """`obj` as JSON at `path`, through a temp file and a move. sort_keys=False keeps the mappings' order where
    it means something (a sweep's grid: first key slowest); hashes never read such a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=sort_keys, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


_work_saved: ContextVar[Callable[[Path], None] | None] = ContextVar("work_saved", default=None)


def work_saved(folder: Path) -> None:
    """A stage body wrote a resumable state (a checkpoint folder) under its work_dir: a shared store
    publishes it now, so a run of the same key on another machine resumes from it."""
    if (publish := _work_saved.get()) is not None:
        publish(folder)


@contextlib.contextmanager
def publishing_work(publish: Callable[[Path], None]) -> Iterator[None]:
    """While inside, `work_saved(folder)` calls `publish(folder)`: in a process a stage launched, the hand-over
    to the stage's own process, which holds the store (stages/training/distributed.py)."""
    token = _work_saved.set(publish)
    try:
        yield
    finally:
        _work_saved.reset(token)


def files_digest(files: list[dict[str, Any]]) -> str:
    """What downstream stages see of an artifact: its files' hashes, the volatile ones left out."""
    return sha256_text(canonical_json({f["path"]: f["sha256"] for f in files if not f.get("volatile")}))


class Store:
    def __init__(self, root: Path | str):
        self.root = Path(root)
        self._hashes: HashMemo | None = None
        # a store this process cannot write, used by a run that needs no write (every stage a hit: see
        # runner.check_store_writable): no refs, events, live registration or .tmp sweep are written
        self.read_only = False

    def __str__(self) -> str:
        return str(self.root)

    # ------------------------------------------------------------ layout
    def artifact_dir(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def hashes(self) -> HashMemo:
        """The memo of input-file hashes kept with this store (plan reads it)."""
        if self._hashes is None:
            self._hashes = HashMemo(self.root / ".state" / "hashes.sqlite")
        return self._hashes

    def work_dir(self, stage: str, key: str) -> Path:
        return self.root / ".work" / f"{stage}-{key}"

    def _lock_path(self, key: str) -> Path:
        return self.root / ".locks" / f"{key}.lock"

    @contextlib.contextmanager
    def lock(self, key: str, what: str = "") -> Iterator[None]:
        """Hold the key's lock, waiting for another run that holds it."""
        with self.try_lock(key, wait=True, what=what):
            yield

    @contextlib.contextmanager
    def try_lock(self, key: str, wait: bool = False, what: str = "") -> Iterator[bool]:
        """Hold the key's lock: yields True, or False at once when a run holds it and `wait` is off."""
        path = self._lock_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    yield False
                    return
                log.info("%s: another run is computing key %s; waiting for it", what or "stage", key[:12])
                fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield True
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    # ------------------------------------------------------------ live runs (what gc must spare)
    @contextlib.contextmanager
    def protecting(self, keys: Iterable[tuple[str, str]]) -> Iterator[None]:
        """While inside, gc keeps these (stage, key)s, artifacts and work: a run's whole plan, from its start
        to its end. Registered under the store-wide gc lock, so a gc sweeping now finishes first. A read-only
        store registers nothing (no gc can run there either)."""
        if self.read_only:
            yield
            return
        with self.lock(GC_LOCK, "run"):
            handle = self._register_live(sorted(keys))
        try:
            yield
        finally:
            try:
                self._release_live(handle)
            except Exception as e:  # noqa: BLE001  (a shared store that stopped answering: the run's own error
                # says so; its registration, a lease, runs out by itself)
                log.warning("store %s: this run's registration was not removed (%s); it runs out by itself", self,
                            store_failure(e))

    def _register_live(self, keys: list[tuple[str, str]]) -> Any:
        path = self.root / ".state" / "live" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"pid": os.getpid(), "started": now_iso(), "keys": keys})
        fh = open(path, "a")  # noqa: SIM115 - held (locked) until the run ends; a dead process drops it
        fcntl.flock(fh, fcntl.LOCK_EX)
        return path, fh

    def _release_live(self, handle: Any) -> None:
        path, fh = handle
        with contextlib.suppress(OSError):
            path.unlink()
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()

    def live_keys(self) -> set[tuple[str, str]]:
        """(stage, key) of every plan a live run on this store protects; a dead run's record is removed."""
        folder, keep = self.root / ".state" / "live", set[tuple[str, str]]()
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                with open(path) as fh:
                    try:
                        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:  # its run holds it: alive
                        keep |= {(s, k) for s, k in json.load(fh).get("keys", [])}
                        continue
                    path.unlink()  # nobody holds it: the run died without ending
            except (OSError, ValueError):
                continue
        return keep

    # ------------------------------------------------------------ reading
    def read_manifest(self, stage: str, key: str) -> dict[str, Any] | None:
        """The parsed manifest when it is a JSON object (check it with manifest_problems before trusting
        its fields), else None."""
        path = self.artifact_dir(stage, key) / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return manifest if isinstance(manifest, dict) else None

    def problems(self, stage: str, key: str, verify: bool = False, memo: bool = False) -> list[str]:
        """Why this artifact is not a valid cache entry ([] when it is). verify: every file's sha256 too,
        read in full, or (memo) through the hash memo, which rereads a file whose stat fields changed."""
        return self.checked(stage, key, verify, memo)[0]

    def checked(self, stage: str, key: str, verify: bool = False, memo: bool = False) \
            -> tuple[list[str], dict[str, Any] | None]:
        """`problems`, and the manifest they were checked against (None when it is unusable)."""
        folder = self.artifact_dir(stage, key)
        if not folder.is_dir():
            return ["not in store"], None
        manifest = self.read_manifest(stage, key)
        if manifest is None:
            return ["manifest.json missing or unreadable"], None
        if bad := manifest_problems(manifest, stage, key):
            return bad, None
        out = []
        for f in manifest.get("files", []):
            p = folder / f["path"]
            if not p.is_file():
                out.append(f"{f['path']}: missing")
            elif p.stat().st_size != f["size"]:
                out.append(f"{f['path']}: size {p.stat().st_size} != {f['size']}")
            elif verify and (self.hashes().sha256(p) if memo else file_sha256(p)) != f["sha256"]:
                out.append(f"{f['path']}: sha256 mismatch")
        return out, manifest

    def entries(self) -> Iterator[tuple[str, str, Path]]:
        """(stage, key, folder) for every committed artifact folder."""
        if not self.root.is_dir():
            return
        for stage_dir in sorted(self.root.iterdir()):
            if stage_dir.name.startswith(".") or stage_dir.name in ("refs", RESULTS) or not stage_dir.is_dir():
                continue
            for key_dir in sorted(stage_dir.iterdir()):
                if key_dir.is_dir() and len(key_dir.name) == 64:
                    yield stage_dir.name, key_dir.name, key_dir

    def exists(self) -> bool:
        return self.root.is_dir()

    BOOKKEEPING = (".locks", ".tmp", ".state", ".work", "refs", "runs")  # written by every run, cached or not

    def unwritable(self) -> str | None:
        """Why this process cannot write the store (None when it can): its root (the nearest folder that exists
        when it does not yet) and the bookkeeping folders a run writes, asked of the OS (a read-only mount,
        permissions, ACLs), nothing written."""
        folder = self.root
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        for path in [folder, *(p for name in self.BOOKKEEPING if (p := self.root / name).is_dir())]:
            if not os.access(path, os.W_OK | os.X_OK):
                try:
                    readonly_fs = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
                except OSError:
                    readonly_fs = False
                return f"{path} is on a read-only file system" if readonly_fs else \
                    f"{path} is not writable by this user"
        return None

    def location(self, stage: str, key: str) -> str:
        """Where the artifact lives, for people: its folder here, its URL on a shared store."""
        return str(self.artifact_dir(stage, key))

    def size(self, stage: str, key: str) -> int:
        """Bytes of an artifact: from its manifest, else what is on disk."""
        m = self.read_manifest(stage, key)
        if m is not None and not manifest_problems(m, stage, key):
            return sum(f["size"] for f in m["files"])
        return folder_size(self.artifact_dir(stage, key))

    def work_entries(self) -> Iterator[tuple[str, str, str, int]]:
        """(stage, key, location, bytes) of every stage's scratch (.work) left by a run that did not commit."""
        work = self.root / ".work"
        if work.is_dir():
            for d in sorted(work.iterdir()):
                stage, _, key = d.name.rpartition("-")
                if d.is_dir() and len(key) == 64:
                    yield stage, key, str(d), folder_size(d)

    def remove(self, stage: str, key: str) -> bool:
        """Delete a committed artifact unless a run holds its key (then False: in use, kept)."""
        return self._remove_folder(key, self.artifact_dir(stage, key), f"gc-{stage}")

    def remove_work(self, stage: str, key: str) -> bool:
        """Delete a key's scratch unless a run holds the key (False: in use, kept)."""
        return self._remove_folder(key, self.work_dir(stage, key), f"gc-work-{stage}")

    def _remove_folder(self, key: str, folder: Path, tag: str) -> bool:
        with self.try_lock(key) as held:
            if not held:
                return False
            trash = self.root / ".tmp" / f"{tag}-{key[:12]}-{uuid.uuid4().hex[:8]}"
            trash.parent.mkdir(parents=True, exist_ok=True)
            os.rename(folder, trash)  # gone from the store at once; then reclaim the space
            shutil.rmtree(trash, ignore_errors=True)
            return True

    def quarantine(self, stage: str, key: str) -> str | None:
        """Move a corrupt artifact out of the store's keys into .quarantine/ (kept for a look; the next run
        recomputes the key); None when a run holds its key."""
        with self.try_lock(key, what=f"quarantine {stage}") as held:
            if not held:
                return None
            target = self.root / ".quarantine" / f"{stage}-{key}-{uuid.uuid4().hex[:8]}"
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(self.artifact_dir(stage, key), target)
            return str(target.relative_to(self.root))

    def verify_all(self, full: bool = True) -> dict[str, list[str]]:
        return {f"{s}/{k}": p for s, k, _ in self.entries() if (p := self.problems(s, k, verify=full))}

    # ------------------------------------------------------------ refs + events
    def refs(self, pipeline: str) -> dict[str, str]:
        try:
            return json.loads((self.root / "refs" / f"{pipeline}.json").read_text())
        except (OSError, ValueError):
            return {}

    def ref_names(self) -> list[str]:
        """Pipelines that have refs (what each last ran), including pipelines no longer in the file."""
        folder = self.root / "refs"
        return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []

    def drop_ref(self, pipeline: str) -> None:
        """Forget what `pipeline` last ran (gc then keeps only its current keys, if it is in the file)."""
        with self.lock(f"refs-{pipeline}"), contextlib.suppress(FileNotFoundError):
            (self.root / "refs" / f"{pipeline}.json").unlink()

    def set_ref(self, pipeline: str, stage: str, key: str) -> None:
        if problem := name_problem(pipeline):  # the schema refuses it first; a ref never escapes the store
            raise ConfigError(f"pipeline name {problem}")
        if self.refs(pipeline).get(stage) == key or self.read_only:
            return  # a cached rerun writes nothing
        with self.lock(f"refs-{pipeline}"):
            refs = self.refs(pipeline)
            refs[stage] = key
            write_json_atomic(self.root / "refs" / f"{pipeline}.json", refs)

    # ------------------------------------------------------------ results (stages/engine/results.py)
    def results(self) -> list[tuple[str, Any]]:
        """(id, parsed JSON or None when unreadable) of every record under results/."""
        folder = self.root / RESULTS
        out: list[tuple[str, Any]] = []
        for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                out.append((p.stem, json.loads(p.read_text())))
            except (OSError, ValueError):
                out.append((p.stem, None))
        return out

    def result(self, rid: str) -> dict[str, Any] | None:
        try:
            record = json.loads((self.root / RESULTS / f"{rid}.json").read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def write_result(self, rid: str, record: dict[str, Any]) -> None:
        write_json_atomic(self.root / RESULTS / f"{rid}.json", record)

    def drop_result(self, rid: str) -> None:
        with self.lock(f"results-{rid}"), contextlib.suppress(FileNotFoundError):
            (self.root / RESULTS / f"{rid}.json").unlink()

    def record_result(self, rid: str, variant: dict[str, Any], stage: str, key: str) -> None:
        """Set one stage's key in the variant's record (made with `variant`'s fields when new)."""
        with self.lock(f"results-{rid}"):
            record = self.result(rid) or {"id": rid, **variant, "keys": {}}
            keys = record.get("keys")
            record["keys"] = {**(keys if isinstance(keys, dict) else {}), stage: key}
            record["updated"] = now_iso()
            self.write_result(rid, record)

    def log_event(self, **event: Any) -> None:
        if self.read_only:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"time": now_iso(), "pid": os.getpid(), **event}, default=str) + "\n"
        fd = os.open(self.root / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def events(self) -> list[dict[str, Any]]:
        try:
            lines = (self.root / "events.jsonl").read_text().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    # ------------------------------------------------------------ running
    def lookup(self, sk: StageKey, upstream_digests: dict[str, str | None], verify: bool = False) -> Lookup:
        """The hit rule (module docstring), decided from the manifest and the file checks; nothing is
        downloaded. `upstream_digests`: each upstream's content digest, None where it is not known yet
        (an upstream that will compute first: then rule 3 is the run's to check)."""
        problems, manifest = self.checked(sk.stage, sk.key, verify=verify)
        if problems or manifest is None:
            return Lookup(False, "; ".join(problems) or "not in store")
        for name, digest in upstream_digests.items():
            recorded = (manifest["upstream"].get(name) or {}).get("digest")
            if digest is not None and recorded != digest:
                return Lookup(False, f"upstream {name} content changed since this artifact was made "
                                     f"({str(recorded)[:12]} -> {digest[:12]})", manifest)
        return Lookup(True, "cached", manifest)

    def run(self, sk: StageKey, body: Callable[..., dict[str, Any] | None], *, pipeline: str, config: dict[str, Any],
            upstream_digests: dict[str, str] | None = None, force: bool = False, verify: bool = False,
            args: Callable[[Path, Path], tuple[Any, ...]] = lambda out, work: (out, work),
            volatile: tuple[str, ...] = ()) -> Outcome:
        """Return sk's artifact: the store's hit (`lookup`; on a shared store nothing is downloaded), else computed by
        body(*args(tmp_dir, work_dir)) -> metrics (a Lazy body is imported only then) and committed (default:
        body(tmp_dir, work_dir)). tmp_dir becomes the artifact; work_dir persists across crashes until the commit.
        `force`: no lookup at all (nothing is fetched)."""
        upstream_digests = upstream_digests or {}
        # a hit needs no lock: a committed artifact is whole (its manifest is written last), so runs that share
        # a stage computed once do not queue on its key; a miss is decided again under the lock
        if not force and (first := self.lookup(sk, dict(upstream_digests), verify)).hit and first.manifest:
            return self._cached(sk, pipeline, first.manifest)
        with self.lock(sk.key, sk.stage):
            found = None if force else self.lookup(sk, dict(upstream_digests), verify)
            if found is not None and found.hit and found.manifest is not None:
                return self._cached(sk, pipeline, found.manifest)
            reason = "forced" if found is None else found.why
            if found is not None and found.manifest is not None:
                log.warning("%s: artifact %s: %s; recomputing it under the same key", sk.stage, sk.key[:12], found.why)
            elif found is not None and found.why != "not in store":
                log.warning("%s: artifact %s is invalid (%s); recomputing", sk.stage, sk.key[:12], found.why)
            replaces = found.manifest["digest"] if found is not None and found.manifest else None
            final = self.artifact_dir(sk.stage, sk.key)
            self.fetch_upstream(sk, upstream_digests)
            self.check_upstream(sk)
            self._clear_tmp(sk)
            tmp = self.root / ".tmp" / f"{sk.stage}-{sk.key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir(parents=True)
            started, t0 = now_iso(), time.perf_counter()
            work = self.work_dir(sk.stage, sk.key)
            work.mkdir(parents=True, exist_ok=True)
            self.fetch_work(sk.stage, sk.key)
            token = _work_saved.set(lambda folder: self.publish_work(sk.stage, sk.key, folder))
            try:
                metrics = loaded(body)(*args(tmp, work)) or {}
                manifest = self._write_manifest(tmp, sk, pipeline, config, upstream_digests, metrics, started,
                                                time.perf_counter() - t0, reason, replaces, volatile)
                self.commit_folder(tmp, final)
                with contextlib.suppress(OSError):  # the downstream stages' upstream check rereads none of it
                    memo = self.local.hashes()
                    for f in manifest["files"]:
                        memo.remember(final / f["path"], f["sha256"])
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)  # a failed body or manifest write leaves nothing behind
                raise
            finally:
                _work_saved.reset(token)
            self.publish(sk.stage, sk.key)
            shutil.rmtree(work, ignore_errors=True)  # committed: the checkpoints are no longer needed anywhere
            self.drop_work(sk.stage, sk.key)
            self.log_event(pipeline=pipeline, stage=sk.stage, key=sk.key, event="computed", reason=reason,
                           duration_s=manifest["duration_s"], **({"replaces": replaces} if replaces else {}))
            return Outcome(sk.stage, sk.key, final, True, reason, manifest)

    def _cached(self, sk: StageKey, pipeline: str, manifest: dict[str, Any]) -> Outcome:
        self.log_event(pipeline=pipeline, stage=sk.stage, key=sk.key, event="cached")
        return Outcome(sk.stage, sk.key, self.artifact_dir(sk.stage, sk.key), False, "cached", manifest)

    # ------------------------------------------------------------ hooks a shared store overrides
    @property
    def local(self) -> Store:
        """The store on this machine's disk that holds the folders stages read (itself, here)."""
        return self

    def materialize(self, stage: str, key: str, digest: str | None = None) -> Path | None:
        """A committed artifact's folder on this machine, its files there (a shared store downloads them
        now); None when it is not in the store (or, with `digest`, holds other content)."""
        folder = self.artifact_dir(stage, key)
        manifest = self.read_manifest(stage, key)
        if manifest is None or (digest is not None and manifest.get("digest") != digest):
            return None
        return folder

    def read_file(self, stage: str, key: str, path: str) -> bytes | None:
        """One file of a committed artifact (None when absent): a report that needs one file of an artifact
        (train's metrics.jsonl) reads it without the artifact's other files."""
        try:
            return (self.artifact_dir(stage, key) / path).read_bytes()
        except OSError:
            return None

    def fetch_upstream(self, sk: StageKey, upstream_digests: dict[str, str]) -> None:
        """Before a body runs: its upstream artifacts' files on this machine (here they are)."""

    def transfers(self) -> dict[str, int] | None:
        """Requests and bytes to and from a shared store so far in this process (None: a local store)."""
        return None

    def publish(self, stage: str, key: str) -> None:
        """Make a freshly committed local artifact visible to other machines (here it already is)."""

    def fetch_work(self, stage: str, key: str) -> None:
        """Before a body runs: bring the key's newest published work (checkpoints) into work_dir."""

    def publish_work(self, stage: str, key: str, folder: Path) -> None:
        """A body saved `folder` under work_dir (see `work_saved`): share it (here the folder is enough)."""

    def drop_work(self, stage: str, key: str) -> None:
        """After the commit: forget the key's published work."""

    def check_upstream(self, sk: StageKey) -> None:
        """Before computing: every upstream file the body will read still has its manifest's sha256 (through
        the hash memo: free for a file unchanged since it was last hashed), so corruption stops where it is
        found instead of being committed under a pristine key."""
        for stage, key in sk.upstream.items():
            if not self.local.artifact_dir(stage, key).is_dir():
                continue  # not read from this store (a joined machine's run)
            if bad := self.local.problems(stage, key, verify=True, memo=True):
                raise CorruptArtifactError(
                    f"{sk.stage}: its upstream {stage} artifact {key[:12]} is corrupt ({'; '.join(bad[:3])}); nothing "
                    f"was computed from it. Run again with --verify to recompute it (finetune inspect verify "
                    f"lists every corrupt artifact)")

    def dead_tmp(self) -> list[Path]:
        """.tmp entries no live process owns: a trash or gc folder whose removal was cut short, or a stage's
        half-written output whose key lock nobody holds (a live writer holds it until it commits)."""
        tmp_root = self.root / ".tmp"
        if not tmp_root.is_dir() or self.read_only:  # its key locks cannot be taken: nothing is known dead
            return []
        dead = []
        for d in sorted(tmp_root.iterdir()):
            if d.name.startswith(("trash-", "gc-")):
                dead.append(d)
            elif m := TMP_NAME.fullmatch(d.name):
                with self.try_lock(m.group("key")) as free:
                    if free:
                        dead.append(d)
        return dead

    def sweep_tmp(self) -> int:
        """Remove the dead .tmp entries (each rechecked under its key's lock); the bytes freed."""
        if self.read_only:
            return 0
        freed = 0
        for d in self.dead_tmp():
            m = TMP_NAME.fullmatch(d.name)
            with self.try_lock(m.group("key")) if m else contextlib.nullcontext(True) as free:
                if free and d.exists():
                    size = folder_size(d)
                    shutil.rmtree(d, ignore_errors=True)
                    freed += size if not d.exists() else 0
        return freed

    def _clear_tmp(self, sk: StageKey) -> None:
        # We hold sk's lock, so any .tmp folder of this key is a dead run's leftover.
        tmp_root = self.root / ".tmp"
        if tmp_root.is_dir():
            for d in tmp_root.glob(f"{sk.stage}-{sk.key}-*"):
                shutil.rmtree(d, ignore_errors=True)

    def _write_manifest(self, tmp: Path, sk: StageKey, pipeline: str, config: dict, upstream_digests: dict,
                        metrics: dict, started: str, duration: float, reason: str,
                        replaces: str | None, volatile: tuple[str, ...] = ()) -> dict[str, Any]:
        files = []
        for p in sorted(tmp.rglob("*")):
            if p.is_file() and p.name != MANIFEST:
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
                rel = str(p.relative_to(tmp))
                files.append({"path": rel, "size": p.stat().st_size, "sha256": file_sha256(p),
                              **({"volatile": True} if any(fnmatch.fnmatch(rel, v) for v in volatile) else {})})
        manifest = {
            "key": sk.key,
            "stage": sk.stage,
            "pipeline": pipeline,
            "config": config,
            "key_inputs": {**sk.key_inputs(), "code_objects": list(sk.code_objects)},
            "upstream": {n: {"key": k, "digest": upstream_digests.get(n)} for n, k in sk.upstream.items()},
            "libraries": sk.libraries,
            "files": files,
            "digest": files_digest(files),
            "started_at": started,
            "finished_at": now_iso(),
            "duration_s": round(duration, 3),
            "metrics": metrics,
            "reason": reason,  # why it was computed: not in store, forced, upstream content changed...
            "replaces": replaces,  # the digest of the artifact this one replaced under the same key, if any
        }
        write_json_atomic(tmp / MANIFEST, manifest)
        fsync_path(tmp)
        return manifest

    def commit_folder(self, tmp: Path, final: Path) -> None:
        """Move a complete folder into place as an artifact (replacing an invalid one)."""
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            trash = self.root / ".tmp" / f"trash-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        fsync_path(final.parent)


def folder_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / f).lstat().st_size
    return total
