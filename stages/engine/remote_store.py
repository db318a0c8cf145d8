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

`file://` URLs use the local disk (rename + flock keep their full strength there). `FsspecBackend` is the
backend (stages/engine/backends.py) that holds these objects; the cache over it is `Store`'s, the same as
on a local disk. `open_store` picks one. On S3 the endpoint and credentials come from boto's standard
settings (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ~/.aws/...).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec

from stages.engine.config import store_root
from stages.engine.errors import StoreUnavailableError, is_unreachable, store_failure
from stages.engine.lease import KeysLease, Lease
from stages.engine.store import Store


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


class FsspecBackend:
    """Objects on an fsspec filesystem (stages/engine/backends.py's protocol), every request counted."""

    def __init__(self, url: str):
        self.root_url = url.rstrip("/")
        fs, self.base = fsspec.core.url_to_fs(self.root_url)
        self._transfers = Transfers()
        self.fs: Any = CountingFS(fs, self._transfers)

    def __str__(self) -> str:
        return self.root_url

    def _r(self, *parts: str) -> str:
        return "/".join([self.base.rstrip("/"), *(p for p in parts if p)])

    def local_path(self, path: str) -> None:
        return None

    def url(self, path: str = "") -> str:
        return f"{self.root_url}/{path}" if path else self.root_url

    def exists(self, path: str) -> bool:
        return not path or self.fs.exists(self._r(path))  # an empty bucket is an empty store

    def read(self, path: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._r(path))
        except (OSError, FileNotFoundError):
            return None

    def write(self, path: str, data: bytes, create: bool = False) -> None:
        self.fs.pipe_file(self._r(path), data, **({"mode": "create"} if create else {}))

    def append(self, log: str, line: bytes) -> None:
        """An object store cannot append: one small object per line, named to sort by time."""
        self.fs.pipe_file(self._r(log, f"{time.time_ns()}-{os.getpid()}-{uuid.uuid4().hex[:6]}.json"), line)

    def lines(self, log: str) -> list[bytes]:
        out = []
        for name in sorted(self.files(log)):
            if (raw := self.read(f"{log}/{name}")) is not None:
                out.append(raw)
        return out

    def files(self, path: str) -> dict[str, int]:
        remote = self._r(path)
        self.fs.invalidate_cache(remote)
        prefix = remote.rstrip("/") + "/"
        try:
            found = self.fs.find(remote, detail=True)
        except FileNotFoundError:
            return {}
        return {p[len(prefix):]: int(info.get("size") or 0) for p, info in found.items() if p.startswith(prefix)}

    def folders(self, path: str) -> list[str]:
        remote = self._r(path)
        self.fs.invalidate_cache(remote)
        try:
            found = self.fs.ls(remote, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in found if e["type"] == "directory")

    def get_file(self, path: str, dest: Path) -> None:
        self.fs.get_file(self._r(path), str(dest))

    def put_file(self, src: Path, path: str, create: bool = False) -> None:
        self.fs.put_file(str(src), self._r(path), **({"mode": "create"} if create else {}))

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._r(path), recursive=True)

    def move(self, src: str, dst: str) -> None:
        self.fs.mv(self._r(src), self._r(dst), recursive=True)

    def lease(self, path: str, what: str, keys: list[tuple[str, str]] | None = None) -> Lease:
        return Lease(self.fs, self._r(path), what=what) if keys is None else KeysLease(self.fs, self._r(path), keys)

    def unwritable(self) -> str | None:
        """A small object written and removed under `.probe/`, so a missing bucket or missing rights show up as
        a write would meet them (two requests, before a run). An endpoint that does not answer raises
        StoreUnavailableError."""
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

    def transfers(self) -> dict[str, int]:
        return self._transfers.snapshot()


class RemoteStore(Store):
    """A `Store` on an fsspec URL, its local cache under `cache` (default $FINETUNE_CACHE): a shorthand that
    names the filesystem for tests and tools that reach past the store (`fs`, `_r`)."""

    def __init__(self, url: str, cache: Path | None = None):
        self.fsspec = FsspecBackend(url)
        super().__init__(self.fsspec, cache)
        self.url, self.base, self._r = self.fsspec.root_url, self.fsspec.base, self.fsspec._r

    @property
    def fs(self) -> Any:
        return self.fsspec.fs

    @fs.setter
    def fs(self, fs: Any) -> None:  # a test's recording filesystem
        self.fsspec.fs = fs


def open_store(root: str | Path | None = None) -> Store:
    """The store at root (default: $FINETUNE_STORE or artifacts/): a local path, a file:// URL (the local
    store), or any other fsspec URL (s3://, gs://, memory://...)."""
    raw = str(root if root is not None else store_root())
    if raw.startswith("file://"):
        return Store(Path(raw[len("file://"):]))
    if "://" in raw:
        return RemoteStore(raw)
    return Store(Path(raw))
