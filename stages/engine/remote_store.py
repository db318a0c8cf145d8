"""The store on an fsspec filesystem (`s3://`, `gs://`, `memory://`...), so several machines share one
cache. Same layout and manifest as the local store; what changes is how the guarantees are kept:

- Commit marker: a stage still writes into a local temporary folder; its files are uploaded into
  `<root>/<stage>/<key>/` and `manifest.json` is uploaded last. An artifact without a manifest (an upload
  killed halfway) is never a hit, and is overwritten by the next writer. Object stores have no atomic
  folder rename; the marker written last gives readers the same all-or-nothing view.
- Lock: a local flock (processes on this machine) plus a lease object `<root>/.locks/<key>.lock`
  (see `stages.engine.lease`): created only if absent (S3's `If-None-Match: *`), renewed by a heartbeat
  while its holder lives, taken over once not renewed for its TTL (a dead holder).
- Fencing: a holder that stalled past the TTL (a stopped process) finds its lease taken over and stops at
  once (`Lease.stopping`), and every write under a lease (an upload, a checkpoint, a removal, a ref) is
  preceded by `Lease.fence()`, so a late run writes nothing. A commit also never overwrites: each file and
  then the manifest is created only if absent (`If-None-Match: *`); an object already there is another
  run's, and only the lease's holder, its fence passed, replaces it (the manifest first: a miss, never two
  runs' files behind one manifest). So a run that stalled inside its own upload cannot replace what the new
  holder committed either: its next create is refused, its fence fails, and it stops. S3 has no
  transaction over two objects, so one gap is left: a stall past the TTL exactly between a passing fence
  and the request after it. Then that one request still lands: a removal (the holder's artifact becomes
  a miss, recomputed by the next run) or the late run's manifest, which stands over the holder's files
  until the holder's own manifest replaces it.
- Lazy fetch: a hit is decided from the manifest and one listing of the artifact's files (their sizes);
  nothing of its payload is downloaded. Its files are downloaded into the local cache ($FINETUNE_CACHE,
  default ~/.cache/finetune/<hash of the URL>), verified by size, only when a stage that computes reads
  them (`fetch_upstream`) or a command asks for the folder (`materialize`): a fully cached run moves
  manifests only. A folder already in the local cache with the same manifest is not downloaded again.
- Every request is counted (`transfers`: GETs, PUTs, other requests and bytes each way); a run reports
  what it moved in its last line and its run record.
- events.jsonl cannot be appended to on an object store: one small JSON object per event instead.

`file://` URLs use the local store (rename + flock keep their full strength there). `RemoteStore` is a
`Store` rooted at its local cache, so computing and committing are the local store's; it overrides the
reads (against the URL) and the fetch/publish/lock hooks. `open_store` picks one. On S3 the endpoint and
credentials come from boto's standard settings (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ~/.aws/...).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec

from stages.engine.config import store_root
from stages.engine.errors import (
    ConfigError,
    CorruptArtifactError,
    StoreUnavailableError,
    is_unreachable,
    store_failure,
)
from stages.engine.fingerprint import sha256_text
from stages.engine.lease import KeysLease, Lease
from stages.engine.lease import alive as lease_alive
from stages.engine.names import name_problem
from stages.engine.paths import cache_dir
from stages.engine.store import MANIFEST, RESULTS, StageKey, Store, log, manifest_problems, now_iso

POLL_S = 0.5


class Transfers:
    """Requests to the shared store and the bytes they moved, counted by `CountingFS` (thread-safe: the
    lease heartbeats count too)."""

    FIELDS = ("get", "get_bytes", "put", "put_bytes", "other")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(self.FIELDS, 0)

    def add(self, **delta: int) -> None:
        with self._lock:
            for k, v in delta.items():
                self.counts[k] += v

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class CountingFS:
    """An fsspec filesystem whose calls are counted: a download (cat_file, get_file) is a GET with its bytes,
    an upload (pipe_file, put_file) a PUT with its bytes, any other call (info, ls, find, rm...) one request."""

    PASS = ("invalidate_cache", "protocol", "sep", "root_marker")

    def __init__(self, fs: Any, transfers: Transfers):
        self._fs, self.transfers = fs, transfers

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if not callable(attr) or name.startswith("_") or name in self.PASS:
            return attr
        count = self.transfers.add

        def counted(*args: Any, **kwargs: Any) -> Any:
            out = attr(*args, **kwargs)
            if name in ("cat_file", "cat"):
                count(get=1, get_bytes=len(out) if isinstance(out, bytes) else 0)
            elif name == "get_file":
                count(get=1, get_bytes=_size(args[1] if len(args) > 1 else kwargs.get("lpath")))
            elif name == "pipe_file":
                data = args[1] if len(args) > 1 else kwargs.get("value", b"")
                count(put=1, put_bytes=len(data))
            elif name == "put_file":
                count(put=1, put_bytes=_size(args[0] if args else kwargs.get("lpath")))
            else:
                count(other=1)
            return out

        return counted


def _size(path: Any) -> int:
    try:
        return os.path.getsize(path)
    except (OSError, TypeError):
        return 0


class RemoteStore(Store):
    """The store on an fsspec URL, rooted at its local cache (`self.local`)."""

    def __init__(self, url: str, cache: Path | None = None):
        self.url = url.rstrip("/")
        fs, self.base = fsspec.core.url_to_fs(self.url)
        self._transfers = Transfers()
        self.fs: Any = CountingFS(fs, self._transfers)
        super().__init__((cache or cache_dir()) / sha256_text(self.url)[:16])
        self._cache = Store(self.root)
        self._leases: dict[str, Lease] = {}  # key -> the lease this process holds on it (try_lock)

    def __repr__(self) -> str:
        return f"RemoteStore({self.url})"

    def __str__(self) -> str:
        return self.url

    @property
    def local(self) -> Store:
        return self._cache

    def location(self, stage: str, key: str) -> str:
        return f"{self.url}/{stage}/{key}"

    def transfers(self) -> dict[str, int] | None:
        return self._transfers.snapshot()

    def exists(self) -> bool:
        return True  # an empty bucket is an empty store

    def unwritable(self) -> str | None:
        """Why this process cannot write the shared store (None when it can): a small object written and
        removed under `.probe/`, so a missing bucket or missing rights show up as a write would meet them
        (two requests, before a run). An endpoint that does not answer raises StoreUnavailableError."""
        probe = self._r(".probe", f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
        except Exception as e:  # noqa: BLE001  (s3fs, gcsfs... each raise their own)
            if is_unreachable(e):  # it cannot be read either: no run can use it
                raise StoreUnavailableError(f"the store {self} cannot be reached: {store_failure(e)}; check its "
                                            f"endpoint (AWS_ENDPOINT_URL) and the network, or set FINETUNE_STORE "
                                            f"to another store") from e
            return store_failure(e)
        return None

    # ------------------------------------------------------------ remote paths
    def _r(self, *parts: str) -> str:
        return "/".join([self.base.rstrip("/"), *parts])

    def read_manifest(self, stage: str, key: str) -> dict[str, Any] | None:
        try:
            manifest = json.loads(self.fs.cat_file(self._r(stage, key, MANIFEST)))
        except (OSError, ValueError, FileNotFoundError):
            return None
        return manifest if isinstance(manifest, dict) else None

    def checked(self, stage: str, key: str, verify: bool = False, memo: bool = False) \
            -> tuple[list[str], dict[str, Any] | None]:
        """The hit rule's checks from the manifest and one listing of the artifact's files (their sizes):
        nothing is downloaded unless `verify` (then every file, to check its sha256)."""
        manifest = self.read_manifest(stage, key)
        if manifest is None:
            return ["not in store" if not self.fs.exists(self._r(stage, key)) else "manifest.json missing"], None
        if bad := manifest_problems(manifest, stage, key):
            return bad, None
        sizes = self._sizes(stage, key)
        out = []
        for f in manifest.get("files", []):
            size = sizes.get(f["path"])
            if size is None:
                out.append(f"{f['path']}: missing")
            elif size != f["size"]:
                out.append(f"{f['path']}: size {size} != {f['size']}")
        if verify and not out:
            local = self.fetch(stage, key, manifest)
            out = self.local.problems(stage, key, verify=True) if local else ["download failed"]
        return out, manifest

    def _sizes(self, stage: str, key: str) -> dict[str, int]:
        """{relative path: size} of the artifact's files on the shared store: one listing request."""
        return self._listing(self._r(stage, key))

    def _listing(self, remote: str) -> dict[str, int]:
        """{path relative to `remote`: size} of every file under it, fresh (no cached listing); {} when absent."""
        self.fs.invalidate_cache(remote)
        prefix = remote.rstrip("/") + "/"
        try:
            found = self.fs.find(remote, detail=True)
        except FileNotFoundError:
            return {}
        return {p[len(prefix):]: int(info.get("size") or 0) for p, info in found.items() if p.startswith(prefix)}

    def size(self, stage: str, key: str) -> int:
        m = self.read_manifest(stage, key)
        return sum(f["size"] for f in m["files"]) if m is not None and not manifest_problems(m, stage, key) else 0

    def entries(self) -> Iterator[tuple[str, str, Path]]:
        if not self.fs.exists(self.base):
            return
        for stage_dir in sorted(self.fs.ls(self.base, detail=False)):
            name = stage_dir.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith(".") or name in ("refs", "events", RESULTS) or not self.fs.isdir(stage_dir):
                continue
            for key_dir in sorted(self.fs.ls(stage_dir, detail=False)):
                key = key_dir.rstrip("/").rsplit("/", 1)[-1]
                if len(key) == 64:
                    yield name, key, self.artifact_dir(name, key)

    def remove(self, stage: str, key: str) -> bool:
        """Delete the shared artifact and its local copy unless a run (here or elsewhere) holds the key."""
        with self.try_lock(key, what=f"gc {stage}") as held:
            if not held:
                return False
            self._fence(key)
            self.fs.rm(self._r(stage, key), recursive=True)
            shutil.rmtree(self.artifact_dir(stage, key), ignore_errors=True)
            return True

    def quarantine(self, stage: str, key: str) -> str | None:
        with self.try_lock(key, what=f"quarantine {stage}") as held:
            if not held:
                return None
            self._fence(key)
            target = f".quarantine/{stage}-{key}-{uuid.uuid4().hex[:8]}"
            self.fs.mv(self._r(stage, key), self._r(*target.split("/")), recursive=True)
            shutil.rmtree(self.artifact_dir(stage, key), ignore_errors=True)
            return target

    def work_entries(self) -> Iterator[tuple[str, str, str, int]]:
        """The shared `.work/<stage>-<key>/` (a run's published checkpoints) and this machine's scratch."""
        seen = set()
        sizes: dict[tuple[str, str], int] = {}
        for path, size in self._listing(self._r(".work")).items():
            stage, _, key = path.split("/", 1)[0].rpartition("-")
            if len(key) == 64:
                sizes[stage, key] = sizes.get((stage, key), 0) + size
        for (stage, key), size in sorted(sizes.items()):
            seen.add((stage, key))
            if not self._lease_alive(key):  # a live run's work, wherever it runs, is not even listed
                yield stage, key, f"{self.url}/.work/{stage}-{key}", size
        for stage, key, location, size in self.local.work_entries():
            if (stage, key) not in seen:
                yield stage, key, location, size

    def _lease_alive(self, key: str) -> bool:
        """A run on some machine holds the key's lease and renewed it within its TTL."""
        try:
            held = json.loads(self.fs.cat_file(self._r(".locks", f"{key}.lock")))
        except (OSError, ValueError, FileNotFoundError):
            return False
        return lease_alive(held)

    def remove_work(self, stage: str, key: str) -> bool:
        """Delete the key's shared work and this machine's scratch unless a run (here or on any machine whose
        lease on the key is alive) holds it."""
        with self.try_lock(key, what=f"gc work {stage}") as held:
            if not held:
                return False
            self._fence(key)
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self._work_url(stage, key), recursive=True)
            shutil.rmtree(self.work_dir(stage, key), ignore_errors=True)
            return True

    # ------------------------------------------------------------ fetch + publish
    def fetch(self, stage: str, key: str, manifest: dict[str, Any]) -> Path | None:
        """The artifact as a local folder (cached; re-fetched when sizes disagree); None when a file cannot
        be downloaded whole."""
        local = self.artifact_dir(stage, key)
        if not self.local.problems(stage, key) and self.local.read_manifest(stage, key) == manifest:
            return local
        tmp = self.local.root / ".tmp" / f"dl-{stage}-{key}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            for f in manifest["files"]:
                dest = tmp / f["path"]
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(self._r(stage, key, f["path"]), str(dest))
                if dest.stat().st_size != f["size"]:
                    raise OSError(f"{f['path']}: downloaded {dest.stat().st_size} bytes, the manifest says {f['size']}")
        except OSError as e:
            log.warning("%s: artifact %s could not be downloaded: %s", stage, key[:12], e)
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
        self.local.commit_folder(tmp, local)
        return local

    def materialize(self, stage: str, key: str, digest: str | None = None) -> Path | None:
        """The local folder of a committed artifact, downloaded unless the local cache has it (with
        `digest`: that content, known without asking the shared store)."""
        mine = self.local.read_manifest(stage, key)
        if digest is not None and mine is not None and mine.get("digest") == digest and \
                not self.local.problems(stage, key):
            return self.artifact_dir(stage, key)
        manifest = self.read_manifest(stage, key)
        if manifest is None or manifest_problems(manifest, stage, key) or \
                (digest is not None and manifest.get("digest") != digest):
            return None
        return self.fetch(stage, key, manifest)

    def read_file(self, stage: str, key: str, path: str) -> bytes | None:
        if (here := super().read_file(stage, key, path)) is not None:  # the local copy, when there is one
            return here
        try:
            return self.fs.cat_file(self._r(stage, key, path))
        except (OSError, FileNotFoundError):
            return None

    def fetch_upstream(self, sk: StageKey, upstream_digests: dict[str, str]) -> None:
        """Before a body runs: download its upstream artifacts (what it reads), unless cached here."""
        for name, key in sk.upstream.items():
            if self.materialize(name, key, upstream_digests.get(name)) is None:
                raise CorruptArtifactError(
                    f"{sk.stage}: its upstream {name} artifact {key[:12]} could not be downloaded from {self.url} "
                    f"(removed, or its files damaged); nothing was computed. Run again with --verify to recompute "
                    f"it (finetune inspect verify lists every damaged artifact)")

    def publish(self, stage: str, key: str) -> None:
        """A freshly computed local artifact to the shared store, manifest last (the commit marker), fenced
        (module docstring): each file created only where nothing is."""
        final, remote = self.artifact_dir(stage, key), self._r(stage, key)
        manifest = json.loads((final / MANIFEST).read_text())
        try:
            self._fence(key)
            if self.fs.exists(remote):  # a forced recompute, an invalid artifact or a dead run's half upload
                self._uncommit(remote)
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(remote, recursive=True)
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
            self.fs.put_file(str(final / path), f"{remote}/{path}", mode="create")
        except FileExistsError:
            self._fence(key)
            self._uncommit(remote)
            self.fs.put_file(str(final / path), f"{remote}/{path}")

    def _uncommit(self, remote: str) -> None:
        """The artifact at `remote` no longer a hit: its manifest removed."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{remote}/{MANIFEST}")

    def _fence(self, key: str) -> None:
        """Before a write under key's lease: LeaseLostError (nothing written) when another run took it over."""
        if (lease := self._leases.get(key)) is not None:
            lease.fence()

    # ------------------------------------------------------------ work (checkpoints) on the shared store
    # `.work/<stage>-<key>/` mirrors a computing key's work_dir with only its newest saved folder, and
    # `latest.json` (written after that folder's files) names it: a run of the key on another machine
    # downloads it and resumes. A folder whose upload was cut off lacks its last file (progress.json for a
    # checkpoint), which the stage's own loader already treats as incomplete.
    def _work_url(self, stage: str, key: str, *parts: str) -> str:
        return self._r(".work", f"{stage}-{key}", *parts)

    def publish_work(self, stage: str, key: str, folder: Path) -> None:
        """Upload `folder` (its file written last, last), the work_dir's files outside its parent folder
        (logs...), then latest.json; the folder replaces its siblings on the shared store."""
        work, remote = self.work_dir(stage, key), self._work_url(stage, key)
        self._fence(key)
        files = [p for p in sorted(work.rglob("*")) if p.is_file() and not p.name.startswith(".tmp-")]
        inside = sorted((p for p in files if folder in p.parents), key=lambda p: p.stat().st_mtime_ns)
        outside = [p for p in files if folder.parent not in p.parents]
        for p in [*outside, *inside]:
            self.fs.put_file(str(p), f"{remote}/{p.relative_to(work)}")
        self._fence(key)
        self.fs.pipe_file(f"{remote}/latest.json", json.dumps(
            {"folder": str(folder.relative_to(work)), "time": now_iso(), "host": socket.gethostname()}).encode())
        parent = "/".join([remote, *folder.parent.relative_to(work).parts])
        self.fs.invalidate_cache(parent)
        self._fence(key)
        for other in self.fs.ls(parent, detail=True):
            if other["type"] == "directory" and other["name"].rstrip("/").rsplit("/", 1)[-1] != folder.name:
                self.fs.rm(other["name"], recursive=True)

    def fetch_work(self, stage: str, key: str) -> None:
        remote, work = self._work_url(stage, key), self.work_dir(stage, key)
        try:
            latest = json.loads(self.fs.cat_file(f"{remote}/latest.json"))
        except (FileNotFoundError, ValueError):
            return
        if (work / latest["folder"]).is_dir():
            return  # this machine wrote it (or fetched it) itself
        log.info("%s: resuming from %s saved on %s at %s", stage, latest["folder"], latest.get("host"),
                 latest.get("time"))
        shutil.rmtree(work, ignore_errors=True)
        prefix = remote.rstrip("/") + "/"  # find() answers paths as url_to_fs gave self.base: no protocol
        for path in self.fs.find(remote):
            rel = path[len(prefix):]
            if rel != "latest.json":
                (work / rel).parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(path, str(work / rel))
        work.mkdir(parents=True, exist_ok=True)

    def drop_work(self, stage: str, key: str) -> None:
        self._fence(key)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._work_url(stage, key), recursive=True)

    # ------------------------------------------------------------ refs + events
    def refs(self, pipeline: str) -> dict[str, str]:
        try:
            return json.loads(self.fs.cat_file(self._r("refs", f"{pipeline}.json")))
        except (OSError, ValueError, FileNotFoundError):
            return {}

    def ref_names(self) -> list[str]:
        folder = self._r("refs")
        if not self.fs.exists(folder):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1].removesuffix(".json")
                      for p in self.fs.ls(folder, detail=False) if p.endswith(".json"))

    def drop_ref(self, pipeline: str) -> None:
        with self.lock(f"refs-{pipeline}"), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._r("refs", f"{pipeline}.json"))

    def set_ref(self, pipeline: str, stage: str, key: str) -> None:
        if problem := name_problem(pipeline):  # the schema refuses it first; a ref never escapes the store
            raise ConfigError(f"pipeline name {problem}")
        if self.refs(pipeline).get(stage) == key or self.read_only:
            return  # a cached rerun writes nothing
        with self.lock(f"refs-{pipeline}"):
            refs = self.refs(pipeline)
            refs[stage] = key
            self._fence(f"refs-{pipeline}")
            self.fs.pipe_file(self._r("refs", f"{pipeline}.json"), json.dumps(refs, indent=2).encode())

    def results(self) -> list[tuple[str, Any]]:
        folder = self._r(RESULTS)
        if not self.fs.exists(folder):
            return []
        out: list[tuple[str, Any]] = []
        for path in sorted(p for p in self.fs.ls(folder, detail=False) if p.endswith(".json")):
            rid = path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".json")
            try:
                out.append((rid, json.loads(self.fs.cat_file(path))))
            except FileNotFoundError:  # dropped since the listing
                continue
            except (OSError, ValueError):
                out.append((rid, None))
        return out

    def result(self, rid: str) -> dict[str, Any] | None:
        try:
            record = json.loads(self.fs.cat_file(self._r(RESULTS, f"{rid}.json")))
        except (OSError, ValueError, FileNotFoundError):
            return None
        return record if isinstance(record, dict) else None

    def write_result(self, rid: str, record: dict[str, Any]) -> None:
        self.fs.pipe_file(self._r(RESULTS, f"{rid}.json"), json.dumps(record, indent=2, sort_keys=True).encode())

    def drop_result(self, rid: str) -> None:
        with self.lock(f"results-{rid}"), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._r(RESULTS, f"{rid}.json"))

    def log_event(self, **event: Any) -> None:
        if self.read_only:
            return
        record = {"time": now_iso(), "pid": os.getpid(), "host": socket.gethostname(), **event}
        name = f"{time.time_ns()}-{os.getpid()}-{uuid.uuid4().hex[:6]}.json"
        self.fs.pipe_file(self._r("events", name), json.dumps(record, default=str).encode())

    def events(self) -> list[dict[str, Any]]:
        folder = self._r("events")
        if not self.fs.exists(folder):
            return []
        out = []
        for path in sorted(self.fs.ls(folder, detail=False), key=lambda p: p.rsplit("/", 1)[-1]):
            with contextlib.suppress(ValueError, FileNotFoundError):
                out.append(json.loads(self.fs.cat_file(path)))
        return out

    # ------------------------------------------------------------ live runs (what gc must spare)
    def _register_live(self, keys: list[tuple[str, str]]) -> Any:
        """On the shared store, a lease (renewed by its heartbeat) that lists the plan's keys: a gc on any
        machine spares them while it is renewed; a dead run's lease runs out (its TTL) and is removed."""
        lease = KeysLease(self.fs, self._r(".live", f"{uuid.uuid4().hex}.json"), keys)
        lease.acquire()
        return lease, self.local._register_live(keys)

    def _release_live(self, handle: Any) -> None:
        lease, local = handle
        lease.release()
        self.local._release_live(local)

    def live_keys(self) -> set[tuple[str, str]]:
        keep: set[tuple[str, str]] = set()
        folder = self._r(".live")
        if not self.fs.exists(folder):
            return keep
        self.fs.invalidate_cache(folder)
        for path in self.fs.ls(folder, detail=False):
            try:
                held = json.loads(self.fs.cat_file(path))
            except (OSError, ValueError):
                continue
            if lease_alive(held):
                keep |= {(s, k) for s, k in held.get("keys", [])}
            else:
                with contextlib.suppress(OSError):
                    self.fs.rm_file(path)  # its run died: the lease ran out
        return keep | self.local.live_keys()

    # ------------------------------------------------------------ locking
    @contextlib.contextmanager
    def try_lock(self, key: str, wait: bool = False, what: str = "") -> Iterator[bool]:
        """This machine's processes (the local flock), then other machines (a lease object)."""
        with self.local.try_lock(key, wait=wait, what=what) as held:
            if not held:
                yield False
                return
            lease = Lease(self.fs, self._r(".locks", f"{key}.lock"), what=what or "stage")
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


def open_store(root: str | Path | None = None) -> Store:
    """The store at root (default: $FINETUNE_STORE or artifacts/): a local path, a file:// URL (the local
    store), or any other fsspec URL (s3://, gs://, memory://...)."""
    raw = str(root if root is not None else store_root())
    if raw.startswith("file://"):
        return Store(Path(raw[len("file://"):]))
    if "://" in raw:
        return RemoteStore(raw)
    return Store(Path(raw))
