"""Local data files read as tables (CSV, TSV, JSONL, a JSON array, Parquet; the first three gzipped too), and
a file's label column summarised for the plan-time label checks (stages/data.py). The data stage's files and
`finetune predict --file` are read here alike. pandas is imported where a file is read, so planning a run
without local data imports none of it."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from stages.engine.errors import DataError

if TYPE_CHECKING:
    import pandas as pd

T = TypeVar("T")

SUFFIXES = (".csv", ".csv.gz", ".tsv", ".tsv.gz", ".jsonl", ".jsonl.gz", ".json", ".parquet")  # what read_table reads
KINDS = "a CSV, TSV or JSONL file (.gz too), a JSON array of objects (.json) or a Parquet file"


def separator(name: str) -> str | None:
    """The field separator of a delimited text file by its (lower-case) name: CSV's comma, TSV's tab; else None."""
    if name.endswith((".csv", ".csv.gz")):
        return ","
    return "\t" if name.endswith((".tsv", ".tsv.gz")) else None


def read_table(path: Path) -> pd.DataFrame:
    import pandas as pd

    name = path.name.lower()
    try:
        if sep := separator(name):
            return read_delimited(path, sep)
        if name.endswith((".jsonl", ".jsonl.gz")):
            table = pd.read_json(path, lines=True)
        elif name.endswith(".json"):
            table = pd.read_json(path)
        elif name.endswith(".parquet"):
            return pd.read_parquet(path)
        else:
            table = None
    except Exception as e:  # pandas / pyarrow / gzip parse errors: one line naming the file and the line
        raise unreadable(path, e) from None
    if table is not None:
        if not all(isinstance(c, str) for c in table.columns):  # values, not objects: ["a", "b"] reads as column 0
            raise not_objects(path)
        return table
    raise DataError(f"{path}: not a {', '.join(SUFFIXES[:-1])} or {SUFFIXES[-1]} file; give {KINDS}")


def read_delimited(path: Path, sep: str, **kwargs: Any) -> pd.DataFrame:
    """A CSV / TSV file as pandas reads it, empty cells as "" (not NaN), but a row with more fields than the
    header an error (pandas would make the first row's extra field the index and shift every column by one:
    index_col=False warns instead, and the warning is raised here)."""
    import pandas as pd

    with warnings.catch_warnings():
        warnings.simplefilter("error", pd.errors.ParserWarning)
        return pd.read_csv(path, sep=sep, keep_default_na=False, index_col=False, **kwargs)


def not_objects(path: Path) -> DataError:
    """A JSON or JSONL file whose rows are values (strings, numbers, lists), not objects naming their columns."""
    if path.name.lower().endswith(".json"):
        return DataError(f"{path}: a JSON array of values, not of objects; give [{{\"text\": ...}}, ...] (or one "
                         f"object per line in a .jsonl file)")
    return unreadable(path, ValueError("not one JSON object per line"))  # it names the first line that is not


def extra_fields(path: Path, sep: str) -> DataError | None:
    """The first record of a CSV / TSV file with more fields than its header, as one line (None: none has)."""
    import csv
    import sys

    limit = csv.field_size_limit(sys.maxsize)
    try:
        with _open_text(path) as fh:
            reader, start, width = csv.reader(fh, delimiter=sep), 1, None
            for record in reader:
                if record and width is None:
                    width = len(record)
                elif width is not None and len(record) > width:
                    what = "comma" if sep == "," else "tab"
                    return DataError(f"{path}: line {start} has {len(record)} fields but the header {width}; quote "
                                     f"a field that holds a {what}, or remove the extra one")
                start = reader.line_num + 1
    except (OSError, ValueError, csv.Error):
        pass
    finally:
        csv.field_size_limit(limit)
    return None


def _open_binary(path: Path):  # noqa: ANN202 - a file object
    import gzip

    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def unreadable(path: Path, e: BaseException) -> DataError:
    """A data file that would not parse, as one line: what is wrong, where (its line), and the fix."""
    import gzip
    import json

    name = path.name.lower()
    if isinstance(e, PermissionError):
        return DataError(f"{path}: cannot be read (permission denied); make it readable, e.g. chmod u+r {path}")
    if path.stat().st_size == 0 or type(e).__name__ == "EmptyDataError":
        return DataError(f"{path}: empty file; give a file with a header line (CSV) or rows")
    try:
        with _open_binary(path) as fh:
            head = fh.read(8000)
            if head.startswith((b"\xff\xfe", b"\xfe\xff")) and not name.endswith(".parquet"):
                return DataError(f"{path}: UTF-16 text; save the file as UTF-8, e.g. iconv -f utf-16 -t utf-8 "
                                 f"{path.name} > utf8-{path.name}")
            if b"\0" in head and not name.endswith(".parquet"):  # git's test for a binary file
                return DataError(f"{path}: a binary file (NUL bytes), not text; give {KINDS}")
            fh.seek(0)
            for i, raw in enumerate(fh, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as u:
                    if name.endswith(".parquet"):
                        break
                    return DataError(f"{path}: line {i} is not UTF-8 (byte 0x{raw[u.start]:02x}); save the file as "
                                     f"UTF-8, e.g. iconv -f latin1 -t utf-8 {path.name} > utf8-{path.name}")
                if name.endswith((".jsonl", ".jsonl.gz")) and text.strip():
                    try:
                        value = json.loads(text)
                    except json.JSONDecodeError as j:
                        return DataError(f"{path}: line {i} is not valid JSON ({j.msg}); fix or "
                                         f"remove that line")
                    if not isinstance(value, dict):
                        return DataError(f"{path}: line {i} is a JSON {type(value).__name__}, not an object; give "
                                         f"one object per line, e.g. {{\"text\": ...}}")
    except gzip.BadGzipFile as o:
        return DataError(f"{path}: cannot be read (not gzip: {o}); compress it with gzip, or drop .gz from its name")
    except OSError as o:  # e.g. a truncated gzip stream
        return DataError(f"{path}: cannot be read ({o}); check the file")
    if name.endswith(".parquet"):
        return DataError(f"{path}: not a readable Parquet file ({one_line(e)}); check the file")
    if (sep := separator(name)) and (extra := extra_fields(path, sep)):
        return extra
    if name.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as fh:
                value = json.load(fh)
        except json.JSONDecodeError as j:
            return DataError(f"{path}: not valid JSON ({j.msg}, line {j.lineno}); a .json file holds one array of "
                             f"objects, [{{\"text\": ...}}, ...]: fix it, or name a file of JSON lines .jsonl")
        if not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
            return DataError(f"{path}: a JSON {type(value).__name__}, not an array of objects; give "
                             f"[{{\"text\": ...}}, ...] (or one object per line in a .jsonl file)")
    return DataError(f"{path}: cannot be parsed ({one_line(e)}); check the file's format")


def one_line(e: BaseException, limit: int = 160) -> str:
    """An exception's message on one line, cut at `limit` characters (a library's message can run to pages)."""
    msg = " ".join(str(e).split()) or type(e).__name__
    return msg if len(msg) <= limit else msg[:limit - 3] + "..."


def places(path: Path, n: int) -> list[str]:
    """Where each of the `n` rows read_table reads from a data file is, for errors, in one pass: its line in a
    CSV or TSV file (a quoted field may span lines) or a JSONL file (blank lines are skipped but counted), else
    (a JSON array, Parquet, or a file this pass counts otherwise) its row, from 1."""
    import csv
    import sys

    name, lines = path.name.lower(), []
    limit = csv.field_size_limit(sys.maxsize)  # pandas reads any length of field; so does this count
    try:
        with _open_text(path) as fh:
            if sep := separator(name):
                reader, start = csv.reader(fh, delimiter=sep), 1
                for record in reader:
                    if record:  # pandas skips blank lines
                        lines.append(start)
                    start = reader.line_num + 1
                lines = lines[1:]  # the header
            elif name.endswith((".jsonl", ".jsonl.gz")):
                lines = [i for i, line in enumerate(fh, 1) if line.strip()]
    except (OSError, ValueError, csv.Error):  # a file read otherwise here: rows, not lines
        lines = []
    finally:
        csv.field_size_limit(limit)
    if len(lines) == n:
        return [f"{path}: line {i}" for i in lines]
    return [f"{path}: row {i}" for i in range(1, n + 1)]


def each_row(check: Callable[[Any, str], T], values: Iterable[Any], path: Path | None, n: int,
             where: Callable[[int], str]) -> list[T]:
    """check(value, where) over rows, each named cheaply by where(i); a row `check` refuses (DataError) is checked
    again named by its line in `path` (places: a pass over the file, made only then), which raises."""
    out = []
    for i, value in enumerate(values):
        try:
            out.append(check(value, where(i)))
        except DataError:
            if path is None:
                raise
            check(value, places(path, n)[i])
            raise
    return out


def _open_text(path: Path):  # noqa: ANN202 - a file object
    import gzip

    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


MISSING_WORDS = ("nan", "na", "n/a", "null", "none")  # a CSV cell holding one of these (any case) is missing


@functools.lru_cache(maxsize=32)
def label_column(path: str, column: str, size: int, mtime_ns: int) -> LabelColumn:
    """The label column of one file, summarised (LabelColumn). Cached per file version: plans run often,
    the column is read once."""
    import pandas as pd

    p = Path(path)
    name = p.name.lower()
    sep = separator(name)
    try:
        if sep:
            values = read_delimited(p, sep, usecols=[column])[column]
        elif name.endswith(".parquet"):
            values = pd.read_parquet(p, columns=[column])[column]
        else:
            values = read_table(p)[column]
    except (KeyError, ValueError) as e:
        if isinstance(e, UnicodeDecodeError) or type(e).__name__ in ("EmptyDataError", "ParserError"):
            raise unreadable(p, e) from None
        return LabelColumn((), None, None, ())  # no such column
    except (OSError, pd.errors.ParserWarning) as e:  # e.g. a .gz that is not gzip, a row with a field too many
        raise unreadable(p, e) from None
    line0 = 2 if sep else 1  # the file's line of row 0 (a CSV's header is line 1)
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
        if sep := separator(name):  # the csv module, not pandas: planning imports no pandas
            with gzip.open(p, "rt", encoding="utf-8-sig", newline="") if name.endswith(".gz") else \
                    p.open(encoding="utf-8-sig", newline="") as fh:
                return tuple(next(csv.reader(fh, delimiter=sep)))
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
