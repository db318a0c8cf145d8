"""Hashes that go into cache keys: the code a stage can execute (stages/engine/codegraph.py: the project
code reachable from its entry points, which Prefect's task-source hash misses), input files (through a
persistent memo, so unchanged multi-GB inputs are not re-read), and library versions."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import sqlite3
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from stages.engine.codegraph import CodeGraph, code_graph, source_signature
from stages.engine.parallel import map_chunks
from stages.engine.paths import PROJECT_ROOT

log = logging.getLogger("finetune.store")

OUTPUT_LIBRARIES = ("torch", "transformers", "tokenizers", "datasets", "peft", "bitsandbytes")
UNRESOLVED = "unresolved"  # a dependency (a hub revision) whose identity could not be pinned when planning


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def digest(closure: dict[str, str]) -> str:
    return sha256_text(json.dumps(closure, sort_keys=True, separators=(",", ":")))


def object_hashes(closure: dict[str, str]) -> list[str]:
    return [f"{k}:{sha256_text(v)[:12]}" for k, v in closure.items()]


# ---------------------------------------------------------------- code


def root_of(obj: Any) -> tuple[str, str]:
    """(module, top-level name) of a function, class or method (or such a pair as it is): where the code
    graph starts."""
    if isinstance(obj, tuple):
        return obj
    obj = getattr(obj, "__func__", obj)
    return obj.__module__, obj.__qualname__.split(".")[0]


def remembered_code_fingerprint(entry_points: list[Callable | type], memo: HashMemo | None = None
                                ) -> tuple[str, list[str]]:
    """code_fingerprint, remembered (in `memo`, else this machine's code_memo()) under the Python version
    and the stat signature of every project source file (path, inode, size, mtime_ns, ctime_ns): a fresh
    process reads no source while none changed."""
    key = "code:" + sha256_text(canonical_json([list(sys.version_info[:2]), source_signature(PROJECT_ROOT),
                                                [".".join(root_of(e)) for e in entry_points]]))
    code, objects = (memo or code_memo()).derived(key, lambda: code_fingerprint(entry_points))
    return code, list(objects)


_CODE_MEMO: list[HashMemo] = []


def code_memo() -> HashMemo:
    """The memo of code fingerprints, one per user (~/.cache/finetune-code/), not one per store or cache: a
    fingerprint belongs to the checkout (its key names every source file's stat fields), so a worker on a
    fresh FINETUNE_CACHE, or a run on another store, does not walk the code again (0.29 s here, bench/run_overhead.py)."""
    if not _CODE_MEMO:
        _CODE_MEMO.append(HashMemo(Path.home() / ".cache" / "finetune-code" / "fingerprints.sqlite"))
    return _CODE_MEMO[0]


def code_fingerprint(entry_points: Iterable[Callable | type], graph: CodeGraph | None = None
                     ) -> tuple[str, list[str]]:
    """(hash over every project object the entry points can reach, ["module.name:sha12", ...] so status
    can name what changed)."""
    closure = (graph or code_graph(PROJECT_ROOT)).closure([root_of(e) for e in entry_points])
    return digest(closure), object_hashes(closure)


# ---------------------------------------------------------------- files


class HashMemo:
    """sha256 of files remembered across processes, keyed by (path, inode, size, mtime_ns, ctime_ns) like
    DVC's state database: a file whose stat fields are all unchanged is not read again; any change to
    them (a write, a touch, a replace) re-hashes it. In-memory when `path` is None."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self._mem: dict[Any, Any] = {}  # (path, stat fields) -> sha256; derived key -> JSON value
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    def _conn(self) -> sqlite3.Connection | None:
        if self.path is None:
            return None
        if self._db is None:
            try:
                self._db = self._open(self.path)
            except OSError as e:  # a folder it cannot create (a read-only home): remembered for this run only
                log.debug("%s: %s; hashes are remembered in memory for this run only", self.path, e)
                self.path = None
                return None
            except sqlite3.DatabaseError as e:  # not a database, or a damaged one: it only remembers hashes
                aside = self.path.with_name(f"{self.path.name}.corrupt")  # the last one, for a look
                with contextlib.suppress(OSError):
                    self.path.replace(aside)
                try:
                    self._db = self._open(self.path)
                    log.warning("%s: unreadable (%s); moved aside to %s and started afresh (hashes are "
                                "recomputed once)", self.path, e, aside.name)
                except sqlite3.Error as e2:
                    log.warning("%s: unusable (%s); hashes are remembered in memory for this run only",
                                self.path, e2)
                    self.path = None
        return self._db

    @staticmethod
    def _open(path: Path) -> sqlite3.Connection:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, timeout=30, check_same_thread=False)
        try:
            db.execute("CREATE TABLE IF NOT EXISTS hashes (path TEXT, inode INTEGER, size INTEGER, "
                       "mtime_ns INTEGER, ctime_ns INTEGER, sha256 TEXT, "
                       "PRIMARY KEY (path, inode, size, mtime_ns, ctime_ns))")
            db.execute("CREATE TABLE IF NOT EXISTS derived (key TEXT PRIMARY KEY, value TEXT)")
            db.execute("SELECT count(*) FROM hashes").fetchone()
        except sqlite3.Error:
            db.close()
            raise
        return db

    def derived(self, key: str, compute: Callable[[], Any]) -> Any:
        """A JSON value computed from files, remembered under `key`, which must name those files' stat
        fields (e.g. a code fingerprint under the signature of every source file it read)."""
        db = self._conn()
        with self._lock:
            if key in self._mem:
                return self._mem[key]
            if db is not None:
                with contextlib.suppress(sqlite3.Error, ValueError):
                    row = db.execute("SELECT value FROM derived WHERE key=?", (key,)).fetchone()
                    if row:
                        self._mem[key] = json.loads(row[0])
                        return self._mem[key]
        value = json.loads(json.dumps(compute()))
        with self._lock:
            self._mem[key] = value
            if db is not None:
                with contextlib.suppress(sqlite3.Error), db:
                    db.execute("INSERT OR REPLACE INTO derived VALUES (?, ?)", (key, json.dumps(value)))
        return value

    def remember(self, path: Path, sha256: str) -> None:
        """Record a hash just computed elsewhere (a file hashed in its temporary folder, then renamed in)."""
        st = path.stat()
        self._record((str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns), sha256)

    def _record(self, memo: tuple, sha256: str) -> None:
        with self._lock:
            self._mem[memo] = sha256
            db = self._conn()
            if db is not None:
                with contextlib.suppress(sqlite3.Error), db:  # an unwritable memo only costs a re-hash
                    db.execute("DELETE FROM hashes WHERE path=?", memo[:1])
                    db.execute("INSERT OR REPLACE INTO hashes VALUES (?,?,?,?,?,?)", (*memo, sha256))

    def sha256(self, path: Path) -> str:
        st = path.stat()
        memo = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with self._lock:
            if memo in self._mem:
                return self._mem[memo]
            db = self._conn()
            if db is not None:
                try:
                    row = db.execute("SELECT sha256 FROM hashes WHERE path=? AND inode=? AND size=? AND "
                                     "mtime_ns=? AND ctime_ns=?", memo).fetchone()
                except sqlite3.Error:
                    row = None  # an unreadable memo only costs a re-hash
                if row:
                    self._mem[memo] = row[0]
                    return row[0]
        value = file_sha256(path)
        self._record(memo, value)
        return value


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


PROCESS_MEMO = HashMemo()


# what an install or an import writes beside the sources (pip compiles a wheel's .py files): never an input
BUILD_DIRS = ("__pycache__",)
BUILD_SUFFIXES = (".pyc", ".pyo")


def inputs_digest(paths: Iterable[Path] | Mapping[str, Path], memo: HashMemo | None = None) -> dict[str, str]:
    """Content hashes of input files; a folder contributes every file under it (relative names). A file is
    named by its folder and name, or, given as {name: path}, by that name alone (its location then is not
    in the key: the data stage's data.path)."""
    memo = memo or PROCESS_MEMO
    named = paths.items() if isinstance(paths, Mapping) else ((None, Path(p)) for p in paths)
    out: dict[str, str] = {}
    for name, p in named:
        p = Path(p)
        if p.is_dir():
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if d not in BUILD_DIRS)
                for f in sorted(f for f in files if not f.endswith(BUILD_SUFFIXES)):
                    fp = Path(root) / f
                    out[f"{name or p.name}/{fp.relative_to(p)}"] = memo.sha256(fp)
        elif p.exists():
            out[name or f"{p.parent.name}/{p.name}"] = memo.sha256(p)
    return out


def sha256_many(paths: list[Path], memo: HashMemo | None = None, jobs: int | None = None) -> list[str]:
    """sha256 of many files, in the order given, each through the memo: by joblib threads (hashlib and file
    reads release the GIL) when there are many, else one by one; the same digests either way."""
    memo = memo or PROCESS_MEMO
    return map_chunks(_sha256_each, paths, jobs=jobs, min_items=64, prefer="threads", memo=memo)


def _sha256_each(paths: list[Path], memo: HashMemo) -> list[str]:
    return [memo.sha256(Path(p)) for p in paths]


def library_versions(names: Iterable[str] = OUTPUT_LIBRARIES) -> dict[str, str]:
    """Installed versions, read from the `<name>-<version>.dist-info` folder names on sys.path (what
    importlib.metadata finds first, without parsing each METADATA file: 7 stages ask for ~36)."""
    installed: dict[str, str] = {}
    for entry in sys.path:
        with contextlib.suppress(OSError):
            for d in os.scandir(entry or "."):
                if d.name.endswith(".dist-info") and "-" in d.name:
                    dist, version = d.name[: -len(".dist-info")].rsplit("-", 1)
                    installed.setdefault(_normalise(dist), version)
    out = {}
    for n in names:
        try:
            out[n] = installed.get(_normalise(n)) or importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            out[n] = "absent"
    return out


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()
