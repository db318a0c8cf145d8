"""Data stage: read the source's splits, split, validate, write one Arrow file per split.

The source (`data.source`, one module of stages/sources each; a `data.path` set: the local files there) says
which files and hub dataset go into the key, reads its splits (the offline mirror's copy before the hub) and
what is known of them before the stage runs; nothing here branches on its name. The IMDB `shuffle_concat` split is the BLOOM article's: the 50k rows in aclImdb order (test/pos,
test/neg, train/pos, train/neg, sorted file names), `sample(frac=1, random_state=seed)`, then
train / validation / test cut by counts.

Labels (seq_cls): integer ids, or names (strings) that map to ids by `data.label_names`, which
`resolve_labels` fills in before any key is computed when the pipeline leaves it null (IMDB and aclImdb:
neg/pos; a string column: its sorted distinct names), with `model.num_labels` when that is null too.
The manifest records the names.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.engine.config import inherited_from
from stages.engine.errors import ConfigError, DataError, MissingInputError
from stages.engine.stage import StageContext
from stages.methods.registry import data_of
from stages.pipeline.schema import DataConfig, PipelineConfig
from stages.sources import SOURCES, source_of
from stages.sources.tables import each_row, places, read_table
from stages.text import conversations as chats

if TYPE_CHECKING:  # pandas, pyarrow: imported where a body reads data, so planning a cached run imports neither
    import pandas as pd


# ------------------------------------------------------------------ where the data comes from: its source


def source_files(cfg: PipelineConfig) -> list[Path] | dict[str, Path]:
    """The files the data stage will read (their content goes into its key)."""
    return source_of(cfg.data).files(cfg.data)


def source_deps(cfg: PipelineConfig) -> dict[str, str]:
    """The hub dataset the data stage will download, pinned to its commit, when no local file or mirror
    serves the data."""
    return source_of(cfg.data).deps(cfg.data)


def load_source(cfg: PipelineConfig) -> tuple[dict[str, pd.DataFrame], str]:
    return source_of(cfg.data).read(cfg.data)


# ------------------------------------------------------------------ labels


def label_ids(values: pd.Series, names: list[str] | None, num_labels: int | None, split: str) -> Any:
    """Class ids of a label column: integer ids as they are, names by their position in `names`."""
    import pandas as pd

    ids = pd.to_numeric(values, errors="coerce")
    if names is not None and (ids.isna() | (ids % 1 != 0)).any():  # names: id = position in data.label_names
        ids = values.astype(str).map({n: i for i, n in enumerate(names)})
        if ids.isna().any():
            first = values[ids.isna()].tolist()[0]
            raise DataError(f"{split} split: {int(ids.isna().sum())} label(s) not in data.label_names {names} "
                            f"(first: {first!r}); add them to data.label_names (or leave it null to take the "
                            f"names from the data) or fix the data")
        return ids.astype("int64").to_numpy()
    assert num_labels is not None  # resolve_labels filled it (or refused the config)
    bad = ids.isna() | (ids < 0) | (ids >= num_labels) | (ids % 1 != 0)
    if bad.any():
        first = values[bad].tolist()[0]
        raise DataError(f"{split} split: {int(bad.sum())} label(s) outside 0..{num_labels - 1} (first: {first!r}); "
                        f"fix the data or set model.num_labels")
    return ids.astype("int64").to_numpy()


def resolve_labels(cfg: PipelineConfig) -> PipelineConfig:
    """classify: fill `data.label_names` and `model.num_labels` when the pipeline leaves them null, from the
    labels the data holds (found_labels), so the data and model stages' keys cover the names and head size
    they use. A count that contradicts the names is a ConfigError naming both."""
    if not data_of(cfg.method.name).classifies:
        return cfg
    names, n = cfg.data.label_names, cfg.model.num_labels
    if names is None:
        names, top = source_of(cfg.data).labels(cfg.data)
        if n is None:
            n = len(names) if names else (max(top + 1, 2) if top is not None else None)
    elif n is None:
        n = len(names)
    if n is None:
        raise ConfigError(f"model.num_labels: cannot be inferred for data.source {cfg.data.source}; set "
                          f"model.num_labels, or name the classes in data.label_names")
    if names is not None and len(names) != n:
        shown = ", ".join(x if len(x) <= 20 else x[:17] + "..." for x in names[:4])
        shown += ", ..." if len(names) > 4 else ""
        where = ("data.label_names lists" if cfg.data.label_names is not None
                 else f"data.label_column '{cfg.data.label_column}' holds")
        raise ConfigError(f"model.num_labels is {n} but {where} {len(names)} names ({shown}); leave "
                          f"model.num_labels out (null) to infer it, or fix data.label_names / data.label_column")
    source_of(cfg.data).check_labels(cfg.data, names, n)
    if names == cfg.data.label_names and n == cfg.model.num_labels:
        return cfg
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"label_names": names}),
                                  "model": cfg.model.model_copy(update={"num_labels": n})})


# ------------------------------------------------------------------ shaping


def row_place(path: Path | None, split: str, n: int, row: int) -> str:
    """Where row `row` of n is, for an error: a local file's line (places), else the split's row."""
    return f"{split} split, row {row}" if path is None else places(path, n)[row]


def conversations(df: pd.DataFrame, d: DataConfig, split: str, path: Path | None = None) -> list[list[dict]]:
    """Each row's conversation (data.format messages or alpaca), checked (DataError naming file, row, field)."""
    where = str(path or split + " split")
    check_columns(where, [str(c) for c in df.columns], named_columns(d, None))
    if d.format == "alpaca":
        inputs = df["input"] if "input" in df.columns else [""] * len(df)
        return each_row(lambda r, at: chats.alpaca(r[0], r[1], r[2], at),
                        zip(df["instruction"], inputs, df["output"], strict=True),
                        path, len(df), lambda i: f"{split} split, row {i}")
    if d.format == "conversation":
        turns = d.conversation or {}
        check_fields(turns, fields_of_columns([str(c) for c in df.columns], d), where)
        return each_row(lambda row, at: chats.from_columns(row, turns, d.label_names, at, d.label_column),
                        df.to_dict("records"), path, len(df), lambda i: f"{split} split, row {i}")
    return each_row(lambda v, at: chats.conversation(v, d.messages_column, d.message_fields, d.roles, at),
                    df[d.messages_column], path, len(df), lambda i: f"{split} split, row {i}")


def fields_of_columns(columns_: list[str], d: Any) -> list[str]:
    """The {fields} data.conversation may write over these columns: each column, and {label} when
    data.label_column is one of them."""
    return columns_ + ["label"] if d.label_column in columns_ and "label" not in columns_ else columns_


def check_fields(turns: Mapping[Any, str], columns_: list[str], where: str, origin: str = "") -> None:
    """Every {field} of data.conversation is a column of the data (ConfigError naming it and the columns)."""
    unknown = sorted(chats.fields_of(turns) - set(columns_))
    if unknown:
        raise ConfigError(f"data.conversation: {{{unknown[0]}}} is not a column of {where} "
                          f"(columns: {', '.join(columns_)}); write one of those in braces{origin}")


ALPACA_FIX = "data.format alpaca reads instruction, input (optional) and output"


def named_columns(d: DataConfig, method: str | None) -> list[tuple[str, str, str]]:
    """(setting, column, fix) for every column the data stage reads of a source for data.format (columns: for
    `method`; None: the conversation formats only). A column setting the method needs but left null: ConfigError."""
    if d.format == "alpaca":
        return [("data.format", c, ALPACA_FIX) for c in ("instruction", "output")]
    if d.format == "messages":
        return [("data.messages_column", d.messages_column, "set data.messages_column to the column holding the "
                 "conversations")]
    if d.format == "conversation" or method is None:
        return []  # conversation: the columns data.conversation names (check_fields)
    facts = data_of(method)
    need = facts.required_columns(d, facts.target_column(d, SOURCES[d.source].target_column))
    if d.target_column:  # named: read as the target when the file has it, so a misspelt one must not go unnoticed
        need.setdefault("data.target_column", d.target_column)
    for key, col in need.items():
        if col is None:
            raise ConfigError(f"{key} is not set but method {method} needs it; set it in pipeline.yaml")
    return [(key, col, f"set {key} to one of them" if key.startswith("data.") else
             f"method {method} reads it: give the data a '{col}' column") for key, col in need.items() if col is not None]


def check_columns(where: str, present: list[str], needed: list[tuple[str, str, str]], cfg: Any = None) -> None:
    """Every needed column is one of `present` (a file's header): else one line naming the file, the column, the
    columns there are and the fix, and where the setting came from when a pipeline it extends set it."""
    for key, col, fix in needed:
        if col not in present:
            raise MissingInputError(f"{where}: no column '{col}' (columns: {', '.join(present)}); {fix}"
                                    f"{came_from(cfg, key) if cfg is not None else ''}")


def came_from(cfg: PipelineConfig, key: str) -> str:
    """' (KEY comes from extends: NAME)' when an extended pipeline set `key`, else ''."""
    parent = inherited_from(cfg, key) if key.startswith("data.") and key != "data.format" else None
    return f" ({key} comes from extends: {parent})" if parent else ""


def refuse_structured(df: pd.DataFrame, columns_: dict[str, str | None], d: DataConfig, split: str,
                      path: Path | None = None) -> None:
    """A text column holding lists or dicts (a conversation, most likely) is refused, never stringified."""
    for key, col in columns_.items():
        if col is None or col not in df.columns or key == "data.label_column":
            continue
        hits = df[col].map(chats.looks_structured)
        if hits.any():
            row = int(hits.to_numpy().argmax())
            raise DataError(f"{row_place(path, split, len(df), row)}, column '{col}': holds a "
                            f"{type(df[col].iloc[row]).__name__}, not text; for a conversation set data.format: "
                            f"messages and data.messages_column: {col} (causal_lm), else give {key} a text column")


def normalise(frames: dict[str, pd.DataFrame], cfg: PipelineConfig) -> dict[str, pd.DataFrame]:
    """Keep id/text/label/target (and the method's own columns) with stable ids; check columns and labels. Conversations (data.format
    messages or alpaca) keep their turns in `messages`; text and target are their last exchange."""
    import pandas as pd

    d, needs = cfg.data, data_of(cfg.method.name)
    target_col = needs.target_column(d, SOURCES[d.source].target_column)
    out = {}
    for split, df in frames.items():
        if d.format != "columns":
            turns = conversations(df, d, split)
            ids = df["id"].astype(str) if "id" in df.columns else pd.Series([f"{split}/{i}" for i in range(len(df))])
            last = [chats.last_exchange(t) for t in turns]
            out[split] = pd.DataFrame({"id": ids.to_numpy(), "text": [a for a, _ in last],
                                       "target": [b for _, b in last], "messages": turns})
            continue
        check_columns(f"{split} split", [str(c) for c in df.columns], named_columns(d, cfg.method.name))
        need = needs.required_columns(d, target_col)
        refuse_structured(df, need, d, split)
        ids = df["id"].astype(str) if "id" in df.columns else pd.Series([f"{split}/{i}" for i in range(len(df))])
        cols = {"id": ids.to_numpy()}
        if needs.text:
            cols["text"] = df[d.text_column].astype(str).to_numpy()
        cols.update({c: df[c].astype(str).to_numpy() for c in needs.columns})
        if needs.classifies:
            cols["label"] = label_ids(df[d.label_column], d.label_names, cfg.model.num_labels, split)
        if target_col and target_col in df.columns:
            cols["target"] = df[target_col].astype(str).to_numpy()
        out[split] = pd.DataFrame(cols)
    return out


def carved_rows(size: int | float, rows: int) -> int:
    """The rows data.split.test / validation carve from a train split of `rows` (a fraction below 1, or a count)."""
    return int(round(size * rows)) if isinstance(size, float) and size < 1 else int(size)


def _carve(df: pd.DataFrame, size: int | float, seed: int, what: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    n = carved_rows(size, len(df))
    if n >= len(df):
        raise DataError(f"data.split.{what} asks for {n} rows but train has only {len(df)}; lower it or give "
                        f"a fraction below 1")
    perm = df.sample(frac=1, random_state=seed)
    return perm.iloc[n:].sort_index(), perm.iloc[:n].sort_index()


def split(frames: dict[str, pd.DataFrame], cfg: PipelineConfig) -> dict[str, pd.DataFrame]:
    import pandas as pd

    sp = cfg.data.split
    if sp.mode == "shuffle_concat":
        order = [s for s in ("test", "train", "validation") if s in frames]
        allrows = pd.concat([frames[s] for s in order], ignore_index=True)
        assert sp.train is not None and sp.validation is not None and sp.test is not None  # SplitConfig checks
        need = sp.train + int(sp.validation) + int(sp.test)
        if need > len(allrows):
            raise DataError(f"data.split asks for {need} rows but the source has {len(allrows)}; lower the counts")
        shuffled = allrows.sample(frac=1, random_state=sp.seed).reset_index(drop=True)
        a, b = sp.train, sp.train + int(sp.validation)
        out = {"train": shuffled.iloc[:a], "validation": shuffled.iloc[a:b], "test": shuffled.iloc[b:need]}
    else:
        if "train" not in frames:
            raise DataError(f"source has no train split (has {', '.join(frames)}); name files train.* or use "
                            f"data.split.mode=shuffle_concat")
        train = frames["train"]
        test = frames.get("test")
        if test is None and sp.test:
            train, test = _carve(train, sp.test, sp.seed, "test")
        val = frames.get("validation")
        if val is None and sp.validation:
            train, val = _carve(train, sp.validation, sp.seed + 1, "validation")
        out = {"train": train, "validation": val, "test": test}
        out = {k: v for k, v in out.items() if v is not None}
    if cfg.data.subset:
        out = {k: (v.iloc[: cfg.data.subset[k]] if k in cfg.data.subset else v) for k, v in out.items()}
    for k, v in out.items():
        if len(v) == 0:
            raise DataError(f"split '{k}' is empty; check the source files and data.split / data.subset")
    return {k: v.reset_index(drop=True) for k, v in out.items()}


def check_rows(cfg: PipelineConfig) -> None:
    """Before any stage runs: conversations need a method that renders them; every column data.* names is in the
    source's header (a local file's or the mirror's, read to the header); a local file's rows are what
    data.format says (each conversation well formed; no list or dict where text is expected), and there are
    enough of them for data.split. Each refused with one line naming the file (its line and field) and the fix."""
    d = cfg.data
    if d.format != "columns" and not data_of(cfg.method.name).chats:
        raise ConfigError(f"data.format {d.format}: conversations are rendered with a chat template for "
                          f"method sft, not {cfg.method.name}; set method: sft or data.format: columns")
    needed = named_columns(d, cfg.method.name)
    source = source_of(d)
    for where, present in source.headers(d):  # a file's header, or the columns the hub's dataset has
        _check_header(cfg, where, present, needed)
    files, place = source.row_files(d)
    rows: dict[str, int] = {}
    for f, split_name in files:
        n = _check_file(str(f), f.stat().st_size, f.stat().st_mtime_ns, d.model_dump_json(), cfg.method.name)
        rows[split_name] = rows.get(split_name, 0) + n
    if files:
        check_split_rows(cfg, rows, place)


def _check_header(cfg: PipelineConfig, where: str, present: list[str], needed: list[tuple[str, str, str]]) -> None:
    d = cfg.data
    check_columns(where, present, needed, cfg)
    if d.format == "conversation":
        check_fields(d.conversation or {}, fields_of_columns(present, d), where, came_from(cfg, "data.conversation"))


def check_split_rows(cfg: PipelineConfig, rows: dict[str, int], where: str) -> None:
    """data.split against the rows a local source has ({split: rows}, from its file names): a split it cannot
    cut is refused with counts that fit, and where data.split came from when a pipeline it extends set it."""
    sp = cfg.data.split
    total = sum(rows.values())
    if sp.mode == "shuffle_concat":
        assert sp.train is not None and sp.validation is not None and sp.test is not None  # SplitConfig checks
        need = sp.train + int(sp.validation) + int(sp.test)
        if need > total:
            held = max(1, total // 10)  # 80 / 10 / 10
            raise DataError(f"data.split asks for {need} rows (train {sp.train} + validation {int(sp.validation)} "
                            f"+ test {int(sp.test)}) but {where} has {total}{came_from(cfg, 'data.split')}; set "
                            f"data.split.train={max(total - 2 * held, 0)}, data.split.validation={held}, "
                            f"data.split.test={held}, or data.split={{mode: source, validation: 0.1, test: 0.1}}")
        return
    if "train" not in rows:
        raise DataError(f"source has no train split (has {', '.join(rows)}); name files train.* or use "
                        f"data.split.mode=shuffle_concat")
    train = rows["train"]
    for what, size in (("test", sp.test), ("validation", sp.validation)):
        if what in rows or not size:
            continue
        n = carved_rows(size, train)
        if n >= train:
            raise DataError(f"data.split.{what} asks for {n} rows but train has only {train} ({where}"
                            f"{', after data.split.test' if what == 'validation' and 'test' not in rows else ''})"
                            f"{came_from(cfg, f'data.split.{what}')}; lower it or give a fraction below 1, e.g. "
                            f"data.split.{what}=0.1")
        train -= n


@functools.lru_cache(maxsize=32)
def _check_file(path: str, size: int, mtime_ns: int, data_json: str, method: str) -> int:
    """check_rows for one file version and data section (plans run often; a file is read once): its rows."""
    f, d = Path(path), DataConfig.model_validate_json(data_json)
    df = read_table(f)
    if d.format != "columns":
        conversations(df, d, "train", f)
        return len(df)
    facts = data_of(method)
    refuse_structured(df, facts.required_columns(d, facts.target_column(d, None)), d, "train", f)
    return len(df)


def makes_validation(cfg: PipelineConfig) -> bool | None:
    """Whether `split` will give a validation split, known before the stage runs from the config and the
    source's split names (the train stage's plan-time check): shuffle_concat always cuts one, source mode
    keeps the source's or carves data.split.validation from train. None: a hub dataset named by data.hub_id,
    whose splits only its download shows."""
    if cfg.data.split.mode == "shuffle_concat" or cfg.data.split.validation:
        return True
    splits = source_splits(cfg)
    return None if splits is None else "validation" in splits


def source_splits(cfg: PipelineConfig) -> set[str] | None:
    """The splits the source has, from file names only (what `load_source` reads them into); None: unknown."""
    return source_of(cfg.data).splits(cfg.data)


def run(ctx: StageContext) -> dict[str, Any]:
    from stages.sources.arrow import write_arrow

    cfg = ctx.cfg
    frames, origin = load_source(cfg)
    splits = split(normalise(frames, cfg), cfg)
    stats: dict[str, Any] = {"source": origin, "rows": {}, "mean_chars": {}}
    for name, df in splits.items():
        write_arrow(df, ctx.out_dir / f"{name}.arrow")
        stats["rows"][name] = len(df)
        text = "text" if "text" in df else next(c for c in df.columns if c != "id")  # a method's own columns
        stats["mean_chars"][name] = round(float(df[text].str.len().mean()), 1)
        if "label" in df:
            stats.setdefault("labels", {})[name] = {str(k): int(v) for k, v in
                                                     df["label"].value_counts().sort_index().items()}
    if data_of(cfg.method.name).classifies and cfg.data.label_names:
        stats["label_names"] = list(cfg.data.label_names)
    ctx.log.info("data: %s rows from %s", stats["rows"], origin)
    return stats
