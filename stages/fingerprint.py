"""Hashes that go into cache keys: the code a stage runs (with the project helpers it calls, which
Prefect's source hash misses), input files, and library versions."""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import os
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

PROJECT_PACKAGES = ("stages", "flows")
OUTPUT_LIBRARIES = ("torch", "transformers", "tokenizers", "datasets", "peft", "bitsandbytes")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _is_project(obj: Any) -> bool:
    mod = getattr(obj, "__module__", None) or ""
    return mod.split(".")[0] in PROJECT_PACKAGES


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def code_closure(fn: Callable) -> dict[str, str]:
    """`module.qualname` -> source for fn and every project function or class it reaches through
    global names (directly, or as attributes of a project module it references)."""
    seen: dict[str, str] = {}
    todo: list[Any] = [fn]
    while todo:
        obj = inspect.unwrap(todo.pop())
        ident = f"{obj.__module__}.{obj.__qualname__}"
        if ident in seen:
            continue
        try:
            seen[ident] = inspect.getsource(obj)
        except (OSError, TypeError):
            seen[ident] = ident
        codes = []
        if inspect.isfunction(obj):
            codes, scope = [obj.__code__], obj.__globals__
        elif inspect.isclass(obj):
            codes = [m.__code__ for m in vars(obj).values() if inspect.isfunction(m)]
            scope = vars(inspect.getmodule(obj)) if inspect.getmodule(obj) else {}
        names: set[str] = set()
        for code in codes:
            names |= _code_names(code)
        for name in names:
            ref = scope.get(name)
            if isinstance(ref, types.ModuleType) and ref.__name__.split(".")[0] in PROJECT_PACKAGES:
                for attr in names:
                    sub = getattr(ref, attr, None)
                    if (inspect.isfunction(sub) or inspect.isclass(sub)) and _is_project(sub):
                        todo.append(sub)
            elif (inspect.isfunction(ref) or inspect.isclass(ref)) and _is_project(ref):
                todo.append(ref)
    return dict(sorted(seen.items()))


def code_fingerprint(fn: Callable) -> tuple[str, list[str]]:
    """(hash over the whole closure, ["module.qualname:sha12", ...] so status can name what changed)."""
    closure = code_closure(fn)
    return sha256_text(canonical_json(closure)), [f"{k}:{sha256_text(v)[:12]}" for k, v in closure.items()]


_file_hash_cache: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    st = path.stat()
    memo = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if memo not in _file_hash_cache:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _file_hash_cache[memo] = h.hexdigest()
    return _file_hash_cache[memo]


def inputs_digest(paths: Iterable[Path]) -> dict[str, str]:
    """Content hashes of input files; a folder contributes every file under it (relative names)."""
    out: dict[str, str] = {}
    for p in paths:
        p = Path(p)
        if p.is_dir():
            for root, dirs, files in os.walk(p):
                dirs.sort()
                for f in sorted(files):
                    fp = Path(root) / f
                    out[f"{p.name}/{fp.relative_to(p)}"] = file_sha256(fp)
        elif p.exists():
            out[f"{p.parent.name}/{p.name}"] = file_sha256(p)
    return out


def library_versions(names: Iterable[str] = OUTPUT_LIBRARIES) -> dict[str, str]:
    out = {}
    for n in names:
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            out[n] = "absent"
    return out
