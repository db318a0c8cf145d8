"""Local data files read as tables (CSV, JSONL, JSON, Parquet; gzipped too), and a file's label column
summarised for the plan-time label checks (stages/data.py). pandas is imported where a file is read, so
planning a run without local data imports none of it."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING

from stages.engine.errors import DataError

if TYPE_CHECKING:
    import pandas as pd


def read_table(path: Path) -> pd.DataFrame:
    import pandas as pd

    name = path.name.lower()
    try:
        if name.endswith((".csv", ".csv.gz")):
            return pd.read_csv(path, keep_default_na=False)
        if name.endswith((".jsonl", ".jsonl.gz")):
            return pd.read_json(path, lines=True)
        if name.endswith(".json"):
            return pd.read_json(path)
        if name.endswith(".parquet"):
            return pd.read_parquet(path)
    except DataError:
        raise
    except Exception as e:  # pandas / pyarrow / gzip parse errors: one line naming the file and the line
        raise unreadable(path, e) from None
    raise DataError(f"{path}: unsupported file type; use .csv, .csv.gz, .jsonl, .json or .parquet")


def _open_binary(path: Path):  # noqa: ANN202 - a file object
    import gzip

    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def unreadable(path: Path, e: BaseException) -> DataError:
    """A data file that would not parse, as one line: what is wrong, where (its line), and the fix."""
    import json

    name = path.name.lower()
    if path.stat().st_size == 0 or type(e).__name__ == "EmptyDataError":
        return DataError(f"{path}: empty file; give a file with a header line (CSV) or rows")
    try:
        with _open_binary(path) as fh:
            for i, raw in enumerate(fh, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as u:
                    return DataError(f"{path}: line {i} is not UTF-8 (byte 0x{raw[u.start]:02x}); save the file as "
                                     f"UTF-8, e.g. iconv -f latin1 -t utf-8 {path.name} > utf8-{path.name}")
                if name.endswith((".jsonl", ".jsonl.gz")) and text.strip():
                    try:
                        json.loads(text)
                    except json.JSONDecodeError as j:
                        return DataError(f"{path}: line {i} is not valid JSON ({j.msg}); fix or "
                                         f"remove that line")
    except OSError as o:  # e.g. a .gz that is not gzip
        return DataError(f"{path}: cannot be read ({o}); check the file")
    if name.endswith(".parquet"):
        return DataError(f"{path}: not a readable Parquet file ({e}); check the file")
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return DataError(f"{path}: cannot be parsed ({msg}); check the file's format")


MISSING_WORDS = ("nan", "na", "n/a", "null", "none")  # a CSV cell holding one of these (any case) is missing


@functools.lru_cache(maxsize=32)
def label_column(path: str, column: str, size: int, mtime_ns: int) -> LabelColumn:
    """The label column of one file, summarised (LabelColumn). Cached per file version: plans run often,
    the column is read once."""
    import pandas as pd

    p = Path(path)
    name = p.name.lower()
    try:
        if name.endswith((".csv", ".csv.gz")):
            values = pd.read_csv(p, usecols=[column], keep_default_na=False)[column]
        elif name.endswith(".parquet"):
            values = pd.read_parquet(p, columns=[column])[column]
        else:
            values = read_table(p)[column]
    except (KeyError, ValueError) as e:
        if isinstance(e, UnicodeDecodeError) or type(e).__name__ in ("EmptyDataError", "ParserError"):
            raise unreadable(p, e) from None
        return LabelColumn((), None, None, ())  # no such column
    except OSError as e:  # e.g. a .gz that is not gzip
        raise unreadable(p, e) from None
    line0 = 2 if name.endswith((".csv", ".csv.gz")) else 1  # the file's line of row 0 (a CSV's header is line 1)
    text = values.map(lambda v: "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v))
    blank = text.str.strip().eq("") | text.str.strip().str.lower().isin(MISSING_WORDS)
    empty = None
    if blank.any():
        row = int(blank.to_numpy().argmax())
        raw = values.iloc[row]
        what = ("empty" if raw.strip() == "" else f"missing ({raw!r})") if isinstance(raw, str) else "missing (null)"
        empty = (row + line0, what)
    ids = pd.to_numeric(values, errors="coerce")
    integer = len(values) > 0 and not (ids.isna() | (ids % 1 != 0)).any()
    firsts = text[~text.duplicated()]
    return LabelColumn(tuple(sorted(set(text[~blank]))), (int(ids.max()) if integer else None), empty,
                       tuple((v, int(i) + line0) for i, v in firsts.items()))


@dataclasses.dataclass(frozen=True)
class LabelColumn:
    values: tuple[str, ...]  # the distinct labels as text, sorted (the missing ones left out)
    top: int | None  # the largest id when every label is an integer, else None
    missing: tuple[int, str] | None  # (line, "empty" / "missing (nan)") of the first label that is not there
    first_lines: tuple[tuple[str, int], ...]  # each distinct label and the line it first appears on


def columns(f: Path) -> list[str]:
    return [str(c) for c in read_table(f).columns]


@functools.lru_cache(maxsize=32)
def header(path: str, size: int, mtime_ns: int) -> tuple[str, ...]:
    """A file's column names, reading as little of it as its format allows (a CSV's header line, a JSONL
    file's first row, a Parquet schema). Cached per file version; an unreadable file is refused (DataError)."""
    import csv
    import gzip
    import json

    p = Path(path)
    name = p.name.lower()
    try:
        if name.endswith((".csv", ".csv.gz")):  # the csv module, not pandas: planning imports no pandas
            with gzip.open(p, "rt", encoding="utf-8-sig", newline="") if name.endswith(".gz") else \
                    p.open(encoding="utf-8-sig", newline="") as fh:
                return tuple(next(csv.reader(fh)))
        if name.endswith((".jsonl", ".jsonl.gz")):
            with gzip.open(p, "rt") if name.endswith(".gz") else p.open() as fh:
                first = next((line for line in fh if line.strip()), "{}")
            row = json.loads(first)
            return tuple(map(str, row)) if isinstance(row, dict) else ()
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            return tuple(pq.read_schema(p).names)
    except Exception as e:
        raise unreadable(p, e) from None
    return tuple(columns(p))
