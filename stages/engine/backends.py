"""Where a store's objects live: the narrow protocol `Store` (stages/engine/store.py) runs over, and the
local-disk backend. The cache (keys, the hit rule, manifests, commit, verify, gc, refs, results, locks) is
the store's alone; a backend holds bytes under '/'-separated paths relative to its root, so a new one
implements objects, never a copy of the cache. The fsspec backend (s3://, memory://...) is
stages/engine/remote_store.py's `FsspecBackend`.

A backend that keeps its objects on this machine's disk says where (`local_path`): the store then writes
them in place, and a folder renamed into place is its commit. Any other backend gets a local cache from the
store: folders are built there, uploaded file by file with the manifest last (the commit marker), and
downloaded only when something reads them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Protocol

from stages.engine.lease import Lease


class Backend(Protocol):
    def local_path(self, path: str) -> Path | None:
        """`path` on this machine's disk when the backend keeps its objects there, else None."""
        ...

    def url(self, path: str = "") -> str:
        """Where `path` is, for people."""
        ...

    def exists(self, path: str) -> bool:
        """A file or a folder is at `path` (the root always is)."""
        ...

    def read(self, path: str) -> bytes | None:
        """The file's bytes; None when it is absent or cannot be read."""
        ...

    def write(self, path: str, data: bytes, create: bool = False) -> None:
        """Replace the file whole (a reader sees the old bytes or the new ones); `create`: only where nothing
        is, else FileExistsError (on S3, `If-None-Match: *`)."""
        ...

    def append(self, log: str, line: bytes) -> None:
        """Add one line to the log `log` (events): lines of concurrent writers are never mixed."""
        ...

    def lines(self, log: str) -> list[bytes]:
        """The log's lines, oldest first."""
        ...

    def files(self, path: str) -> dict[str, int]:
        """{path relative to `path`: size} of every file under the folder, fresh; {} when absent."""
        ...

    def folders(self, path: str) -> list[str]:
        """The names of the folder's sub-folders, sorted; [] when absent."""
        ...

    def get_file(self, path: str, dest: Path) -> None:
        """Copy the file to `dest` on this machine."""
        ...

    def put_file(self, src: Path, path: str, create: bool = False) -> None:
        """Copy a file of this machine to `path` (`create` as in `write`)."""
        ...

    def remove(self, path: str) -> None:
        """Delete a file or a folder with all it holds, at once for readers; nothing there is fine."""
        ...

    def move(self, src: str, dst: str) -> None:
        """Move a folder to another path."""
        ...

    def lease(self, path: str, what: str, keys: list[tuple[str, str]] | None = None) -> Lease | None:
        """A lease object at `path` that processes on other machines respect (`keys`: a live run's plan, which
        gc spares); None where this machine's locks are all there is (a local disk)."""
        ...

    def unwritable(self) -> str | None:
        """Why this process cannot write here (None when it can)."""
        ...

    def transfers(self) -> dict[str, int] | None:
        """Requests and bytes moved so far in this process (None: nothing is moved, a local disk)."""
        ...


class LocalBackend:
    """Objects as files under a folder of this machine."""

    BOOKKEEPING = (".locks", ".tmp", ".state", ".work", "refs", "runs")  # written by every run, cached or not

    def __init__(self, root: Path):
        self.root = root

    def __str__(self) -> str:
        return str(self.root)

    def local_path(self, path: str) -> Path:
        return self.root / path if path else self.root

    def url(self, path: str = "") -> str:
        return str(self.local_path(path))

    def exists(self, path: str) -> bool:
        return self.local_path(path).exists()

    def read(self, path: str) -> bytes | None:
        try:
            return self.local_path(path).read_bytes()
        except OSError:
            return None

    def write(self, path: str, data: bytes, create: bool = False) -> None:
        target = self.local_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if create:
            with open(target, "xb") as f:
                f.write(data)
            return
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)

    def append(self, log: str, line: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.local_path(f"{log}.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def lines(self, log: str) -> list[bytes]:
        return (self.read(f"{log}.jsonl") or b"").splitlines()

    def files(self, path: str) -> dict[str, int]:
        top, out = self.local_path(path), {}
        for folder, _, names in os.walk(top):
            for name in names:
                with contextlib.suppress(OSError):
                    p = Path(folder) / name
                    out[p.relative_to(top).as_posix()] = p.stat().st_size
        return out

    def folders(self, path: str) -> list[str]:
        top = self.local_path(path)
        return sorted(d.name for d in top.iterdir() if d.is_dir()) if top.is_dir() else []

    def get_file(self, path: str, dest: Path) -> None:
        shutil.copyfile(self.local_path(path), dest)

    def put_file(self, src: Path, path: str, create: bool = False) -> None:
        if create and self.exists(path):
            raise FileExistsError(path)
        self.local_path(path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, self.local_path(path))

    def remove(self, path: str) -> None:
        target = self.local_path(path)
        if not target.is_dir():
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            return
        # gone from the store at once; then the space is reclaimed (a sweep finishes what a crash cut short)
        trash = self.root / ".tmp" / f"gc-{uuid.uuid4().hex[:8]}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.rename(target, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def move(self, src: str, dst: str) -> None:
        self.local_path(dst).parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.local_path(src), self.local_path(dst))

    def lease(self, path: str, what: str, keys: list[tuple[str, str]] | None = None) -> None:
        return None  # every process that shares this disk takes the store's flock

    def unwritable(self) -> str | None:
        """The root (the nearest folder that exists when it does not yet) and the bookkeeping folders a run
        writes, asked of the OS (a read-only mount, permissions, ACLs), nothing written."""
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

    def transfers(self) -> None:
        return None
