"""data.source local (and any source with data.path set): the user's own files at `data.path`: a CSV, TSV,
JSONL, JSON or Parquet file (the train split), a folder of split files (train*, validation*, test*), or aclImdb
as Stanford ships it (the extracted folder or aclImdb_v1.tar.gz; stages/sources/aclimdb.py). Keyed by its files'
content and names, not where they lie."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.engine.errors import ConfigError, DataError, MissingInputError
from stages.engine.paths import PROJECT_ROOT, why_missing
from stages.sources.imdb import LABEL_NAMES as ACLIMDB_LABEL_NAMES
from stages.sources.source import Frames, Labels, Source, split_of
from stages.sources.tables import SUFFIXES, LabelColumn, columns, header, label_column, read_table


def local_path(raw: str | None) -> Path:
    if not raw:
        raise ConfigError("data.path: not set; give the local CSV/TSV/JSONL/JSON/Parquet file or folder to read")
    for base in (Path.cwd(), PROJECT_ROOT):
        p = (base / raw).expanduser() if not Path(raw).is_absolute() else Path(raw)
        if p.exists():
            return p
    raise MissingInputError(f"data.path {raw}: {why_missing(Path(raw).expanduser())}; give an existing "
                            f"CSV/TSV/JSONL/JSON/Parquet file, a folder of split files, or an aclImdb folder/tarball")


def is_aclimdb(path: Path) -> bool:
    return (path.is_dir() and (path / "train" / "pos").is_dir()) or path.name.endswith((".tar.gz", ".tgz", ".tar"))


def tables(d: Any) -> list[Path] | None:
    """The tabular files data.path holds (None for aclImdb, whose labels are its folders)."""
    path = local_path(d.path)
    if is_aclimdb(path):
        return None
    return [path] if path.is_file() else [f for f in sorted(path.iterdir())
                                          if f.name.lower().endswith(SUFFIXES) and split_of(f.name)]


def read_local(path: Path) -> Frames:
    import pandas as pd

    from stages.sources import aclimdb

    if path.is_dir() and (path / "train" / "pos").is_dir():
        return aclimdb.read_folder(path)
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz", ".tar")):
        return aclimdb.read_tarball(path)
    if path.is_file():
        return {"train": read_table(path)}
    frames: dict[str, list[pd.DataFrame]] = {}
    for f in sorted(path.iterdir()):
        if f.name.lower().endswith(SUFFIXES) and (split := split_of(f.name)):
            frames.setdefault(split, []).append(read_table(f))
    if not frames:
        raise MissingInputError(f"{path}: no train*/test*/validation* .csv/.tsv/.jsonl/.json/.parquet files in this folder")
    return {s: pd.concat(fs, ignore_index=True) for s, fs in frames.items()}


def label_columns(d: Any) -> list[tuple[Path, LabelColumn]]:
    """Each local file's label column, a file without the column or with a missing label refused (DataError
    naming the file, its line and the column)."""
    out = []
    for f in tables(d) or []:
        col = label_column(str(f), d.label_column or "", f.stat().st_size, f.stat().st_mtime_ns)
        if not col.values and col.missing is None:
            if d.label_column not in (names := columns(f)):
                raise MissingInputError(f"{f}: no column '{d.label_column}' (columns: {', '.join(names)}); "
                                        f"set data.label_column to one of them")
            continue  # an empty file: the data stage says so
        if col.missing is not None:
            line, what = col.missing
            raise DataError(f"{f}: line {line}, column '{d.label_column}': {what} label; give every row its "
                            f"class (or remove the row)")
        out.append((f, col))
    return out


class Local(Source):
    name = "local"

    def files(self, d: Any) -> list[Path] | dict[str, Path]:
        """A local data.path is keyed by its file's name (a folder: its files' names inside it), not where it lies:
        moved, it hits the cache."""
        path = local_path(d.path)
        return {"data.path" if path.is_dir() else f"data.path {path.name}": path}

    def read(self, d: Any) -> tuple[Frames, str]:
        path = local_path(d.path)
        return read_local(path), f"local:{path}"

    def splits(self, d: Any) -> set[str] | None:
        files = tables(d)
        if files is None:  # aclImdb
            return {"train", "test"}
        return {"train"} if local_path(d.path).is_file() else {s for f in files if (s := split_of(f.name))}

    def headers(self, d: Any) -> list[tuple[str, list[str]]]:
        path, files = local_path(d.path), tables(d)
        if files is None:  # aclImdb: what aclimdb.read_* give
            return [(str(path), ["id", "text", "label"])]
        return [(str(f), list(header(str(f), f.stat().st_size, f.stat().st_mtime_ns))) for f in files]

    def row_files(self, d: Any) -> tuple[list[tuple[Path, str]], str]:
        path, files = local_path(d.path), tables(d)
        named = [(f, "train" if f == path else split_of(f.name) or "train") for f in files or []]
        return named, path.name if path.is_file() else f"{path}'s files"

    def labels(self, d: Any) -> Labels:
        """aclImdb's are neg/pos; a file's are read (its label column only, when the format allows): names when
        any label is not an integer id (then every label is a name), else the largest id."""
        if tables(d) is None:
            return list(ACLIMDB_LABEL_NAMES), 1
        found = label_columns(d)
        if any(col.top is None for _, col in found):
            return sorted({v for _, col in found for v in col.values}), None
        return None, max((col.top for _, col in found if col.top is not None), default=None)

    def check_labels(self, d: Any, names: list[str] | None, n: int) -> None:
        if tables(d) is None:
            return
        for f, col in label_columns(d):
            if col.top is not None and names is None:
                bad = [(v, line) for v, line in col.first_lines if not 0 <= int(float(v)) < n]
                fix = f"is outside 0..{n - 1} (model.num_labels {n}); fix the data or set model.num_labels"
            elif names is not None:
                ok = set(names) | ({str(i) for i in range(len(names))} if col.top is not None else set())
                bad = [(v, line) for v, line in col.first_lines if v not in ok]
                fix = (f"is not in data.label_names {names}; add it there (or leave data.label_names null) or fix "
                       f"the data")
            else:
                continue
            if bad:
                value, line = bad[0]
                raise DataError(f"{f}: line {line}, column '{d.label_column}': label {value!r} {fix}")


SOURCE = Local()
