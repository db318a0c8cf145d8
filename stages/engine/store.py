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

`Store` holds the one skeleton (cached -> lock -> compute -> commit -> publish) and all of the cache, over
a narrow backend protocol (stages/engine/backends.py: bytes under paths, a folder's files, a lease): the
local disk, or fsspec (s3://, memory://...; stages/engine/remote_store.py, which says how a shared store
keeps these guarantees without a rename). On a shared store the folders above are this machine's local
cache, and a hit downloads nothing: folders are fetched only when something reads them.
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
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from stages.engine.backends import Backend, LocalBackend
from stages.engine.errors import ConfigError, CorruptArtifactError, store_failure
from stages.engine.fingerprint import HashMemo, canonical_json, file_sha256, sha256_text
from stages.engine.lease import Lease
from stages.engine.lease import alive as lease_alive
from stages.engine.names import name_problem
from stages.engine.paths import cache_dir
from stages.engine.stage import loaded

log = logging.getLogger("finetune.store")
MANIFEST = "manifest.json"
GC_LOCK = "gc"  # the store-wide lock: gc's sweep, a run's registration
RESULTS = "results"  # results/<id>.json: what gc keeps until dropped (stages/engine/results.py)
POLL_S = 0.5  # how often a run waiting for another machine's lease asks again
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


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=2, sort_keys=True, default=str).encode()


class Store:
    """The cache over a backend (stages/engine/backends.py). `root` is the folder on this machine that holds
    what a run works in (.tmp, .work, .locks, .state, runs/) and the artifact folders stages read: the store
    itself on a local disk, else the store's local cache ($FINETUNE_CACHE/<hash of its URL>)."""

    def __init__(self, where: Path | str | Backend, cache: Path | None = None):
        self.backend: Backend = LocalBackend(Path(where)) if isinstance(where, str | Path) else where
        here = self.backend.local_path("")
        # shared: the objects live elsewhere; this machine keeps copies of what it read or made under root
        self.shared = here is None
        self.root = here if here is not None else (cache or cache_dir()) / sha256_text(self.backend.url())[:16]
        self._hashes: HashMemo | None = None
        # a store this process cannot write, used by a run that needs no write (every stage a hit: see
        # runner.check_store_writable): no refs, events, live registration or .tmp sweep are written
        self.read_only = False
        self._leases: dict[str, Lease] = {}  # key -> the lease this process holds on it (try_lock)

    def __str__(self) -> str:
        return self.backend.url()

    def __repr__(self) -> str:
        return f"Store({self})"

    # ------------------------------------------------------------ layout
    def artifact_dir(self, stage: str, key: str) -> Path:
        """The artifact's folder on this machine (on a shared store: its copy, downloaded when read)."""
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
        """Hold the key's lock: yields True, or False at once when a run holds it and `wait` is off. This
        machine's processes take a flock; other machines, the backend's lease object (where it has one)."""
        with self._flock(key, wait, what) as held:
            if not held:
                yield False
                return
            lease = self.backend.lease(f".locks/{key}.lock", what or "stage")
            if lease is None:
                yield True
                return
            announced = False
            while not lease.acquire():
                if not wait:
                    yield False
                    return
                if not announced:
                    log.info("%s: another machine holds the lease on %s; waiting", what or "stage", key[:12])
                    announced = True
                time.sleep(POLL_S)
            self._leases[key] = lease
            try:
                with lease.stopping():  # taken over (this process stalled): stopped here, at once
                    yield True
            finally:
                self._leases.pop(key, None)
                lease.release()

    @contextlib.contextmanager
    def _flock(self, key: str, wait: bool, what: str) -> Iterator[bool]:
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

    def _fence(self, key: str) -> None:
        """Before a write under key's lease: LeaseLostError (nothing written) when another run took it over."""
        if (lease := self._leases.get(key)) is not None:
            lease.fence()

    def _lease_alive(self, key: str) -> bool:
        """A run on some machine holds the key's lease and renewed it within its TTL."""
        held = self._json(f".locks/{key}.lock")
        return isinstance(held, dict) and lease_alive(held)

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
        """A record on this machine, flocked until the run ends (a dead process drops it), and on a backend
        with leases one that lists the keys, renewed by its heartbeat: a gc on any machine spares them while
        it is renewed; a dead run's lease runs out (its TTL) and is removed."""
        lease = self.backend.lease(f".live/{uuid.uuid4().hex}.json", "run", keys)
        if lease is not None:
            lease.acquire()
        path = self.root / ".state" / "live" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"pid": os.getpid(), "started": now_iso(), "keys": keys})
        fh = open(path, "a")  # noqa: SIM115 - held (locked) until the run ends
        fcntl.flock(fh, fcntl.LOCK_EX)
        return lease, path, fh

    def _release_live(self, handle: Any) -> None:
        lease, path, fh = handle
        if lease is not None:
            lease.release()
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
        if not self.shared:
            return keep
        for name in self.backend.files(".live"):
            held = self._json(f".live/{name}")
            if not isinstance(held, dict):
                continue
            if lease_alive(held):
                keep |= {(s, k) for s, k in held.get("keys", [])}
            else:
                with contextlib.suppress(OSError):
                    self.backend.remove(f".live/{name}")  # its run died: the lease ran out
        return keep

    # ------------------------------------------------------------ reading
    def _json(self, path: str) -> Any:
        """The parsed JSON file at `path` on the backend; None when absent or not JSON."""
        raw = self.backend.read(path)
        try:
            return None if raw is None else json.loads(raw)
        except ValueError:
            return None

    def read_manifest(self, stage: str, key: str) -> dict[str, Any] | None:
        """The parsed manifest when it is a JSON object (check it with manifest_problems before trusting
        its fields), else None."""
        manifest = self._json(f"{stage}/{key}/{MANIFEST}")
        return manifest if isinstance(manifest, dict) else None

    def problems(self, stage: str, key: str, verify: bool = False, memo: bool = False) -> list[str]:
        """Why this artifact is not a valid cache entry ([] when it is). verify: every file's sha256 too,
        read in full, or (memo) through the hash memo, which rereads a file whose stat fields changed."""
        return self.checked(stage, key, verify, memo)[0]

    def checked(self, stage: str, key: str, verify: bool = False, memo: bool = False) \
            -> tuple[list[str], dict[str, Any] | None]:
        """`problems`, and the manifest they were checked against (None when it is unusable): from the manifest
        and one listing of the artifact's files (their sizes); on a shared store nothing is downloaded unless
        `verify` (then every file, to check its sha256)."""
        manifest = self.read_manifest(stage, key)
        if manifest is None:
            if not self.backend.exists(f"{stage}/{key}"):
                return ["not in store"], None
            present = self.backend.exists(f"{stage}/{key}/{MANIFEST}")
            return ["manifest.json unreadable" if present else "manifest.json missing"], None
        if bad := manifest_problems(manifest, stage, key):
            return bad, None
        sizes = self.backend.files(f"{stage}/{key}")
        out = []
        for f in manifest["files"]:
            size = sizes.get(f["path"])
            if size is None:
                out.append(f"{f['path']}: missing")
            elif size != f["size"]:
                out.append(f"{f['path']}: size {size} != {f['size']}")
        if verify and not out:
            folder = self.fetch(stage, key, manifest)
            out = ["download failed"] if folder is None else self._hash_problems(folder, manifest, memo)
        return out, manifest

    def _hash_problems(self, folder: Path, manifest: dict[str, Any], memo: bool) -> list[str]:
        hashed = self.hashes().sha256 if memo else file_sha256
        return [f"{f['path']}: sha256 mismatch" for f in manifest["files"] if hashed(folder / f["path"]) != f["sha256"]]

    def _copy_problems(self, stage: str, key: str, verify: bool = False) -> tuple[list[str], dict[str, Any] | None]:
        """`checked` of this machine's copy of the artifact (on a local disk: the artifact itself), through
        the hash memo."""
        folder = self.artifact_dir(stage, key)
        if not folder.is_dir():
            return ["not in store"], None
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except (OSError, ValueError):
            return ["manifest.json missing or unreadable"], None
        if bad := manifest_problems(manifest, stage, key):
            return bad, None
        out = []
        for f in manifest["files"]:
            p = folder / f["path"]
            if not p.is_file():
                out.append(f"{f['path']}: missing")
            elif p.stat().st_size != f["size"]:
                out.append(f"{f['path']}: size {p.stat().st_size} != {f['size']}")
        return out or (self._hash_problems(folder, manifest, memo=True) if verify else []), manifest

    def entries(self) -> Iterator[tuple[str, str, Path]]:
        """(stage, key, folder) for every committed artifact folder."""
        for stage in self.backend.folders(""):
            if stage.startswith(".") or stage in ("refs", "events", RESULTS):
                continue
            for key in self.backend.folders(stage):
                if len(key) == 64:
                    yield stage, key, self.artifact_dir(stage, key)

    def exists(self) -> bool:
        return self.backend.exists("")

    def unwritable(self) -> str | None:
        """Why this process cannot write the store (None when it can), asked of the backend before a run."""
        return self.backend.unwritable()

    def location(self, stage: str, key: str) -> str:
        """Where the artifact lives, for people: its folder here, its URL on a shared store."""
        return self.backend.url(f"{stage}/{key}")

    def size(self, stage: str, key: str) -> int:
        """Bytes of an artifact: from its manifest, else what its folder holds."""
        m = self.read_manifest(stage, key)
        if m is not None and not manifest_problems(m, stage, key):
            return sum(f["size"] for f in m["files"])
        return sum(self.backend.files(f"{stage}/{key}").values())

    def work_entries(self) -> Iterator[tuple[str, str, str, int]]:
        """(stage, key, location, bytes) of every stage's scratch (.work) left by a run that did not commit:
        on a shared store its published checkpoints (a live run's, wherever it runs, not even listed), and
        this machine's scratch."""
        seen = set()
        if self.shared:
            sizes: dict[tuple[str, str], int] = {}
            for path, size in self.backend.files(".work").items():
                stage, _, key = path.split("/", 1)[0].rpartition("-")
                if len(key) == 64:
                    sizes[stage, key] = sizes.get((stage, key), 0) + size
            for (stage, key), size in sorted(sizes.items()):
                seen.add((stage, key))
                if not self._lease_alive(key):
                    yield stage, key, self.backend.url(f".work/{stage}-{key}"), size
        work = self.root / ".work"
        for d in sorted(work.iterdir()) if work.is_dir() else []:
            stage, _, key = d.name.rpartition("-")
            if d.is_dir() and len(key) == 64 and (stage, key) not in seen:
                yield stage, key, str(d), folder_size(d)

    def remove(self, stage: str, key: str) -> bool:
        """Delete a committed artifact (and this machine's copy) unless a run holds its key (then False: in
        use, kept)."""
        with self.try_lock(key, what=f"gc {stage}") as held:
            if not held:
                return False
            self._fence(key)
            self.backend.remove(f"{stage}/{key}")
            if self.shared:
                shutil.rmtree(self.artifact_dir(stage, key), ignore_errors=True)
            return True

    def remove_work(self, stage: str, key: str) -> bool:
        """Delete a key's scratch (shared and here) unless a run holds the key (False: in use, kept)."""
        with self.try_lock(key, what=f"gc work {stage}") as held:
            if not held:
                return False
            self._fence(key)
            self.backend.remove(f".work/{stage}-{key}")
            shutil.rmtree(self.work_dir(stage, key), ignore_errors=True)
            return True

    def quarantine(self, stage: str, key: str) -> str | None:
        """Move a corrupt artifact out of the store's keys into .quarantine/ (kept for a look; the next run
        recomputes the key); None when a run holds its key."""
        with self.try_lock(key, what=f"quarantine {stage}") as held:
            if not held:
                return None
            self._fence(key)
            target = f".quarantine/{stage}-{key}-{uuid.uuid4().hex[:8]}"
            self.backend.move(f"{stage}/{key}", target)
            if self.shared:
                shutil.rmtree(self.artifact_dir(stage, key), ignore_errors=True)
            return target

    def verify_all(self, full: bool = True) -> dict[str, list[str]]:
        return {f"{s}/{k}": p for s, k, _ in self.entries() if (p := self.problems(s, k, verify=full))}

    # ------------------------------------------------------------ refs + events
    def refs(self, pipeline: str) -> dict[str, str]:
        refs = self._json(f"refs/{pipeline}.json")
        return refs if isinstance(refs, dict) else {}

    def ref_names(self) -> list[str]:
        """Pipelines that have refs (what each last ran), including pipelines no longer in the file."""
        return sorted(p.removesuffix(".json") for p in self.backend.files("refs") if p.endswith(".json")
                      and "/" not in p)

    def drop_ref(self, pipeline: str) -> None:
        """Forget what `pipeline` last ran (gc then keeps only its current keys, if it is in the file)."""
        with self.lock(f"refs-{pipeline}"):
            self.backend.remove(f"refs/{pipeline}.json")

    def set_ref(self, pipeline: str, stage: str, key: str) -> None:
        if problem := name_problem(pipeline):  # the schema refuses it first; a ref never escapes the store
            raise ConfigError(f"pipeline name {problem}")
        if self.refs(pipeline).get(stage) == key or self.read_only:
            return  # a cached rerun writes nothing
        with self.lock(f"refs-{pipeline}"):
            refs = self.refs(pipeline)
            refs[stage] = key
            self._fence(f"refs-{pipeline}")
            self.backend.write(f"refs/{pipeline}.json", _json_bytes(refs))

    # ------------------------------------------------------------ results (stages/engine/results.py)
    def results(self) -> list[tuple[str, Any]]:
        """(id, parsed JSON or None when unreadable) of every record under results/."""
        out: list[tuple[str, Any]] = []
        for name in sorted(p for p in self.backend.files(RESULTS) if p.endswith(".json") and "/" not in p):
            raw = self.backend.read(f"{RESULTS}/{name}")
            if raw is None:  # dropped since the listing
                continue
            try:
                out.append((name.removesuffix(".json"), json.loads(raw)))
            except ValueError:
                out.append((name.removesuffix(".json"), None))
        return out

    def result(self, rid: str) -> dict[str, Any] | None:
        record = self._json(f"{RESULTS}/{rid}.json")
        return record if isinstance(record, dict) else None

    def write_result(self, rid: str, record: dict[str, Any]) -> None:
        self.backend.write(f"{RESULTS}/{rid}.json", _json_bytes(record))

    def drop_result(self, rid: str) -> None:
        with self.lock(f"results-{rid}"):
            self.backend.remove(f"{RESULTS}/{rid}.json")

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
        record = {"time": now_iso(), "pid": os.getpid(), "host": socket.gethostname(), **event}
        self.backend.append("events", json.dumps(record, default=str).encode() + b"\n")

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.backend.lines("events"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def transfers(self) -> dict[str, int] | None:
        """Requests and bytes to and from a shared store so far in this process (None: a local store)."""
        return self.backend.transfers()

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
                    memo = self.hashes()
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

    # ------------------------------------------------------------ moving folders to and from a shared store
    def fetch(self, stage: str, key: str, manifest: dict[str, Any]) -> Path | None:
        """The artifact as a folder on this machine: a local disk's own, else this machine's copy (downloaded
        unless it holds this manifest, verified by size); None when a file cannot be downloaded whole."""
        if (here := self.backend.local_path(f"{stage}/{key}")) is not None:
            return here
        local = self.artifact_dir(stage, key)
        bad, mine = self._copy_problems(stage, key)
        if not bad and mine == manifest:
            return local
        tmp = self.root / ".tmp" / f"dl-{stage}-{key}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            for f in manifest["files"]:
                dest = tmp / f["path"]
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.backend.get_file(f"{stage}/{key}/{f['path']}", dest)
                if dest.stat().st_size != f["size"]:
                    raise OSError(f"{f['path']}: downloaded {dest.stat().st_size} bytes, the manifest says {f['size']}")
        except OSError as e:
            log.warning("%s: artifact %s could not be downloaded: %s", stage, key[:12], e)
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
        self.commit_folder(tmp, local)
        return local

    def materialize(self, stage: str, key: str, digest: str | None = None) -> Path | None:
        """A committed artifact's folder on this machine, its files there (a shared store downloads them now
        unless this machine's copy has `digest`, known without asking it); None when it is not in the store
        (or, with `digest`, holds other content)."""
        if self.shared and digest is not None:
            bad, mine = self._copy_problems(stage, key)
            if not bad and mine is not None and mine.get("digest") == digest:
                return self.artifact_dir(stage, key)
        manifest = self.read_manifest(stage, key)
        if manifest is None or (digest is not None and manifest.get("digest") != digest) or \
                (self.shared and manifest_problems(manifest, stage, key)):
            return None
        return self.fetch(stage, key, manifest)

    def read_file(self, stage: str, key: str, path: str) -> bytes | None:
        """One file of a committed artifact (None when absent): a report that needs one file of an artifact
        (train's metrics.jsonl) reads it without the artifact's other files (this machine's copy first)."""
        try:
            return (self.artifact_dir(stage, key) / path).read_bytes()
        except OSError:
            return self.backend.read(f"{stage}/{key}/{path}") if self.shared else None

    def fetch_upstream(self, sk: StageKey, upstream_digests: dict[str, str]) -> None:
        """Before a body runs on a shared store: its upstream artifacts (what it reads) downloaded, unless
        this machine has them."""
        if not self.shared:
            return
        for name, key in sk.upstream.items():
            if self.materialize(name, key, upstream_digests.get(name)) is None:
                raise CorruptArtifactError(
                    f"{sk.stage}: its upstream {name} artifact {key[:12]} could not be downloaded from {self} "
                    f"(removed, or its files damaged); nothing was computed. Run again with --verify to recompute "
                    f"it (finetune inspect verify lists every damaged artifact)")

    def publish(self, stage: str, key: str) -> None:
        """A freshly committed folder to a shared store (on a local disk the commit was its rename), manifest
        last (the commit marker), fenced: each file created only where nothing is (remote_store's docstring)."""
        if not self.shared:
            return
        final, remote = self.artifact_dir(stage, key), f"{stage}/{key}"
        manifest = json.loads((final / MANIFEST).read_text())
        try:
            self._fence(key)
            if self.backend.exists(remote):  # a forced recompute, an invalid artifact or a dead run's half upload
                self.backend.remove(f"{remote}/{MANIFEST}")
                self.backend.remove(remote)
            for path in [*(f["path"] for f in manifest["files"]), MANIFEST]:
                if path == MANIFEST:
                    self._fence(key)
                self._create(key, final, remote, path)
        except BaseException:  # not the shared artifact: no local copy of it either (read_file reads that first)
            shutil.rmtree(final, ignore_errors=True)
            raise

    def _create(self, key: str, final: Path, remote: str, path: str) -> None:
        """Upload a file where nothing is (If-None-Match: *). An object there was written since this upload
        began, by a run that stalled past the TTL inside its own: this run stops if the fence says it is the
        late one; else it replaces the object, the manifest first (an artifact is then a miss until this
        run's manifest lands, never a mix of two runs' files behind one manifest)."""
        try:
            self.backend.put_file(final / path, f"{remote}/{path}", create=True)
        except FileExistsError:
            self._fence(key)
            self.backend.remove(f"{remote}/{MANIFEST}")
            self.backend.put_file(final / path, f"{remote}/{path}")

    # `.work/<stage>-<key>/` on a shared store mirrors a computing key's work_dir with only its newest saved
    # folder, and `latest.json` (written after that folder's files) names it: a run of the key on another
    # machine downloads it and resumes. A folder whose upload was cut off lacks its last file (progress.json
    # for a checkpoint), which the stage's own loader already treats as incomplete.
    def publish_work(self, stage: str, key: str, folder: Path) -> None:
        """A body saved `folder` under work_dir (see `work_saved`): on a shared store, upload it (its file
        written last, last), the work_dir's files outside its parent folder (logs...), then latest.json; the
        folder replaces its siblings there. On a local disk the folder is enough."""
        if not self.shared:
            return
        work, remote = self.work_dir(stage, key), f".work/{stage}-{key}"
        self._fence(key)
        files = [p for p in sorted(work.rglob("*")) if p.is_file() and not p.name.startswith(".tmp-")]
        inside = sorted((p for p in files if folder in p.parents), key=lambda p: p.stat().st_mtime_ns)
        outside = [p for p in files if folder.parent not in p.parents]
        for p in [*outside, *inside]:
            self.backend.put_file(p, f"{remote}/{p.relative_to(work).as_posix()}")
        self._fence(key)
        self.backend.write(f"{remote}/latest.json", json.dumps(
            {"folder": folder.relative_to(work).as_posix(), "time": now_iso(), "host": socket.gethostname()}).encode())
        parent = "/".join([remote, *folder.parent.relative_to(work).parts])
        self._fence(key)
        for other in self.backend.folders(parent):
            if other != folder.name:
                self.backend.remove(f"{parent}/{other}")

    def fetch_work(self, stage: str, key: str) -> None:
        """Before a body runs: bring the key's newest published work (checkpoints) into work_dir."""
        if not self.shared:
            return
        remote, work = f".work/{stage}-{key}", self.work_dir(stage, key)
        latest = self._json(f"{remote}/latest.json")
        if not isinstance(latest, dict) or (work / latest["folder"]).is_dir():
            return  # none, or this machine wrote it (or fetched it) itself
        log.info("%s: resuming from %s saved on %s at %s", stage, latest["folder"], latest.get("host"),
                 latest.get("time"))
        shutil.rmtree(work, ignore_errors=True)
        for rel in self.backend.files(remote):
            if rel != "latest.json":
                (work / rel).parent.mkdir(parents=True, exist_ok=True)
                self.backend.get_file(f"{remote}/{rel}", work / rel)
        work.mkdir(parents=True, exist_ok=True)

    def drop_work(self, stage: str, key: str) -> None:
        """After the commit: forget the key's published work."""
        if self.shared:
            self._fence(key)
            self.backend.remove(f".work/{stage}-{key}")

    def check_upstream(self, sk: StageKey) -> None:
        """Before computing: every upstream file the body will read still has its manifest's sha256 (through
        the hash memo: free for a file unchanged since it was last hashed), so corruption stops where it is
        found instead of being committed under a pristine key."""
        for stage, key in sk.upstream.items():
            if not self.artifact_dir(stage, key).is_dir():
                continue  # not read from this store (a joined machine's run)
            if bad := self._copy_problems(stage, key, verify=True)[0]:
                raise CorruptArtifactError(
                    f"{sk.stage}: its upstream {stage} artifact {key[:12]} is corrupt ({'; '.join(bad[:3])}); nothing "
                    f"was computed from it. Run again with --verify to recompute it (finetune inspect verify "
                    f"lists every corrupt artifact)")

    # ------------------------------------------------------------ this machine's .tmp
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
                with self._flock(m.group("key"), False, "") as free:
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
            with self._flock(m.group("key"), False, "") if m else contextlib.nullcontext(True) as free:
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
