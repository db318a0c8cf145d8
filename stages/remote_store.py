"""The store on an fsspec filesystem (`s3://`, `gs://`, `memory://`...), so several machines share one
cache. Same layout and manifest as the local store; what changes is how the guarantees are kept:

- Commit marker: a stage still writes into a local temporary folder; its files are uploaded into
  `<root>/<stage>/<key>/` and `manifest.json` is uploaded last. An artifact without a manifest (an upload
  killed halfway) is never a hit, and is overwritten by the next writer. Object stores have no atomic
  folder rename; the marker written last gives readers the same all-or-nothing view.
- Lock: a local flock (processes on this machine) plus a lease object `<root>/.locks/<key>.lock`
  created with exclusive create (`xb`) where the filesystem supports it; a lease older than
  `LEASE_TTL_S` is taken over (its writer died).
- Stages need local folders: artifacts are downloaded once into a local cache
  ($FINETUNE_CACHE, default ~/.cache/finetune/<hash of the URL>), verified by size, and handed on.
- events.jsonl cannot be appended to on an object store: one small JSON object per event instead.

`file://` URLs use the local store (rename + flock keep their full strength there).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec

from stages.fingerprint import sha256_text
from stages.store import MANIFEST, StageKey, Store, log, now_iso

LEASE_TTL_S = 6 * 3600
POLL_S = 0.5


class RemoteStore(Store):
    def __init__(self, url: str, cache: Path | None = None):
        self.url = url.rstrip("/")
        self.fs, self.base = fsspec.core.url_to_fs(self.url)
        cache_root = cache or Path(os.environ.get("FINETUNE_CACHE") or Path.home() / ".cache" / "finetune")
        super().__init__(cache_root / sha256_text(self.url)[:16])  # self.root: the local cache

    def __repr__(self) -> str:
        return f"RemoteStore({self.url})"

    # ------------------------------------------------------------ remote paths
    def _r(self, *parts: str) -> str:
        return "/".join([self.base.rstrip("/"), *parts])

    def read_manifest(self, stage: str, key: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.fs.cat_file(self._r(stage, key, MANIFEST)))
        except (OSError, ValueError, FileNotFoundError):
            return None

    def problems(self, stage: str, key: str, verify: bool = False) -> list[str]:
        manifest = self.read_manifest(stage, key)
        if manifest is None:
            return ["not in store" if not self.fs.exists(self._r(stage, key)) else "manifest.json missing"]
        if manifest.get("key") != key or manifest.get("stage") != stage:
            return ["manifest belongs to another key"]
        out = []
        for f in manifest.get("files", []):
            try:
                size = self.fs.size(self._r(stage, key, f["path"]))
            except FileNotFoundError:
                out.append(f"{f['path']}: missing")
                continue
            if size != f["size"]:
                out.append(f"{f['path']}: size {size} != {f['size']}")
        if verify and not out:
            local = self._download(stage, key, manifest)
            out = super().problems(stage, key, verify=True) if local else ["download failed"]
        return out

    def entries(self) -> Iterator[tuple[str, str, Path]]:
        if not self.fs.exists(self.base):
            return
        for stage_dir in sorted(self.fs.ls(self.base, detail=False)):
            name = stage_dir.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith(".") or name in ("refs", "events") or not self.fs.isdir(stage_dir):
                continue
            for key_dir in sorted(self.fs.ls(stage_dir, detail=False)):
                key = key_dir.rstrip("/").rsplit("/", 1)[-1]
                if len(key) == 64:
                    yield name, key, self.artifact_dir(name, key)

    def remove(self, stage: str, key: str) -> None:
        self.fs.rm(self._r(stage, key), recursive=True)
        shutil.rmtree(self.artifact_dir(stage, key), ignore_errors=True)

    # ------------------------------------------------------------ local copies
    def _download(self, stage: str, key: str, manifest: dict[str, Any]) -> Path | None:
        """The artifact as a local folder (cached; re-fetched when sizes disagree)."""
        local = self.artifact_dir(stage, key)
        if not Store.problems(self, stage, key) and Store.read_manifest(self, stage, key) == manifest:
            return local
        tmp = self.root / ".tmp" / f"dl-{stage}-{key}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        for f in manifest["files"]:
            dest = tmp / f["path"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(self._r(stage, key, f["path"]), str(dest))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
        self._commit(tmp, local)
        return local

    # ------------------------------------------------------------ refs + events
    def refs(self, pipeline: str) -> dict[str, str]:
        try:
            return json.loads(self.fs.cat_file(self._r("refs", f"{pipeline}.json")))
        except (OSError, ValueError, FileNotFoundError):
            return {}

    def set_ref(self, pipeline: str, stage: str, key: str) -> None:
        with self.lock(f"refs-{pipeline}"):
            refs = self.refs(pipeline)
            refs[stage] = key
            self.fs.pipe_file(self._r("refs", f"{pipeline}.json"), json.dumps(refs, indent=2).encode())

    def log_event(self, **event: Any) -> None:
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

    # ------------------------------------------------------------ locking
    @contextlib.contextmanager
    def lock(self, key: str, what: str = "") -> Iterator[None]:
        with super().lock(key, what):  # this machine's processes
            lease = self._r(".locks", f"{key}.lock")
            self.fs.makedirs(self._r(".locks"), exist_ok=True)
            announced = False
            while not self._take_lease(lease):
                if not announced:
                    log.info("%s: another machine holds the lease on %s; waiting", what or "stage", key[:12])
                    announced = True
                time.sleep(POLL_S)
            try:
                yield
            finally:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(lease)

    def _take_lease(self, lease: str) -> bool:
        body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode()
        try:
            with self.fs.open(lease, "xb") as f:
                f.write(body)
            return True
        except FileExistsError:
            try:
                held = json.loads(self.fs.cat_file(lease))
            except (FileNotFoundError, ValueError):
                return False
            if time.time() - held.get("time", 0) > LEASE_TTL_S:
                log.warning("lease %s is older than %d s; its holder died, taking it over", lease, LEASE_TTL_S)
                self.fs.rm_file(lease)
            return False
        except (NotImplementedError, ValueError):  # no exclusive create on this filesystem: best effort
            self.fs.pipe_file(lease, body)
            return True

    # ------------------------------------------------------------ running
    def cached(self, sk: StageKey, upstream_digests: dict[str, str], verify: bool) -> tuple[dict | None, str]:
        manifest, why = super().cached(sk, upstream_digests, verify)
        if manifest is not None and self._download(sk.stage, sk.key, manifest) is None:
            return None, "download failed"
        return manifest, why

    def _commit(self, tmp: Path, final: Path) -> None:
        """Local commit into the cache; for a freshly computed artifact, upload it (manifest last)."""
        super()._commit(tmp, final)
        stage, key = final.parent.name, final.name
        if tmp.name.startswith("dl-"):
            return
        remote = self._r(stage, key)
        if self.fs.exists(remote):  # a forced recompute or a half-uploaded artifact: invalidate it first
            self.fs.rm(remote, recursive=True)
        manifest = json.loads((final / MANIFEST).read_text())
        for f in manifest["files"]:
            self.fs.put_file(str(final / f["path"]), f"{remote}/{f['path']}")
        self.fs.put_file(str(final / MANIFEST), f"{remote}/{MANIFEST}")
