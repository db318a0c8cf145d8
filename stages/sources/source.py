"""What a data source is (`data.source`, one module of stages/sources each, registered in SOURCES in
stages/sources/__init__.py): where its files are, which of them and which hub dataset go into the data stage's
key, its default columns, how it reads its splits and what is known of them before the stage runs. The data
stage (stages/data.py) asks the source and never branches on its name.

Most sources are a hub dataset with a copy in the offline mirror ($FINETUNE_DATA_MIRROR or `data.mirror`, laid
out like ../shared/data, one folder per source): HubSource reads the mirror's files when it has them, else the
hub."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.engine.paths import work_root
from stages.sources.hub import ensure_hub_reachable, hub_identity
from stages.sources.tables import header, read_table

if TYPE_CHECKING:  # pandas: imported where a body reads data, so planning a cached run imports none of it
    import pandas as pd

Frames = dict[str, "pd.DataFrame"]
Labels = tuple[list[str] | None, int | None]  # (class names, largest integer id): found_labels


class Source:
    """One data source; the defaults are a source with no files of its own and labels unknown."""

    name: str = ""
    hub_id: str | None = None  # the hub dataset read when data.hub_id is null
    target_column: str | None = None  # data.target_column when it is null (seq2seq / causal_lm)
    label_names: list[str] | None = None  # the class names its labels have (id i is label_names[i]), if fixed
    mirror_layout: str = ""  # its files in the offline mirror, for the hub-unreachable fix

    def files(self, d: Any) -> list[Path] | dict[str, Path]:
        """The files the data stage reads (their content goes into its key)."""
        return []

    def deps(self, d: Any) -> dict[str, str]:
        """What else the data stage reads, pinned (a hub dataset's commit), for its key."""
        return {}

    def read(self, d: Any) -> tuple[Frames, str]:
        """{split: frame} and where they were read from (the manifest's `source`)."""
        raise NotImplementedError

    def splits(self, d: Any) -> set[str] | None:
        """The splits `read` gives, known from names alone; None: unknown before it runs."""
        return None

    def headers(self, d: Any) -> list[tuple[str, list[str]]]:
        """(where, columns) of what `read` gives, known before it runs: the plan's column checks read them."""
        return []

    def row_files(self, d: Any) -> tuple[list[tuple[Path, str]], str]:
        """(file, split) of each file whose rows the plan checks (a user's own files), and how to name them."""
        return [], ""

    def labels(self, d: Any) -> Labels:
        """(names, largest integer id) of its labels before the data stage runs (resolve_labels)."""
        return (list(self.label_names), len(self.label_names) - 1) if self.label_names else (None, None)

    def check_labels(self, d: Any, names: list[str] | None, n: int) -> None:
        """Before the run: every label is one of `names` (names given), or an id below n."""


def mirror_root(d: Any) -> Path | None:
    """The offline mirror's folder ($FINETUNE_DATA_MIRROR wins over data.mirror; relative: to the work root)."""
    raw = os.environ.get("FINETUNE_DATA_MIRROR") or d.mirror
    if not raw:
        return None
    path = Path(raw).expanduser()
    if not path.is_absolute():
        path = work_root() / path
    return path if path.is_dir() else None


def split_of(name: str) -> str | None:
    """The split a file's name says (train / validation / test), or None."""
    low = name.lower()
    for split, words in (("validation", ("validation", "valid", "val", "dev")), ("test", ("test",)),
                         ("train", ("train",))):
        if any(w in low.replace("-", "_").split("_") or low.startswith(w) for w in words):
            return split
    return None


def concat_by_split(files: list[Path]) -> Frames:
    """Each file read and concatenated into the split its name says (no split named: train)."""
    import pandas as pd

    frames: dict[str, list[pd.DataFrame]] = {}
    for f in files:
        frames.setdefault(split_of(f.name) or "train", []).append(read_table(f))
    return {s: pd.concat(v, ignore_index=True) for s, v in frames.items()}


class HubSource(Source):
    """A hub dataset, read from the offline mirror's folder `name` when that has its files."""

    hub_splits: tuple[str, ...] = ("train", "test")  # the splits `read_hub` keeps
    hub_columns: tuple[str, ...] = ()  # the columns its hub dataset has

    def mirror_files(self, d: Any) -> list[Path]:
        """Its files in the offline mirror ([] when the mirror lacks them)."""
        raise NotImplementedError

    def read_mirror(self, files: list[Path]) -> Frames:
        return concat_by_split(files)

    def order(self, frames: Frames) -> Frames:
        """The hub's splits in the order the mirror's files hold the rows."""
        return frames

    def hub_dataset(self, d: Any) -> str:
        """The hub dataset it reads: data.hub_id, else its own."""
        return str(d.hub_id or self.hub_id or self.name)

    def files(self, d: Any) -> list[Path] | dict[str, Path]:
        return self.mirror_files(d)

    def deps(self, d: Any) -> dict[str, str]:
        if self.mirror_files(d):
            return {}
        return hub_identity(self.hub_dataset(d), d.hub_revision, "dataset")

    def read(self, d: Any) -> tuple[Frames, str]:
        if files := self.mirror_files(d):
            return self.read_mirror(files), f"mirror:{files[0].parent}"
        hub_id = self.hub_dataset(d)
        return self.read_hub(d, hub_id), f"hub:{hub_id}"

    def read_hub(self, d: Any, hub_id: str) -> Frames:
        from stages.sources import SOURCES

        layouts = ", ".join(s.mirror_layout for s in SOURCES.values() if s.mirror_layout)
        ensure_hub_reachable(
            f"dataset {hub_id}",
            f"point the pipeline at local files: set FINETUNE_DATA_MIRROR to a folder laid out like ../shared/data "
            f"({layouts}), or --set data.source=local --set data.path=FILE")
        import datasets

        ds = datasets.load_dataset(hub_id, revision=d.hub_revision)
        return self.order({s: ds[s].to_pandas() for s in ("train", "test", "validation") if s in ds})

    def splits(self, d: Any) -> set[str] | None:
        if files := self.mirror_files(d):
            return {split_of(f.name) or "train" for f in files}
        return set(self.hub_splits) if d.hub_id is None else None

    def headers(self, d: Any) -> list[tuple[str, list[str]]]:
        files = self.mirror_files(d)
        if not files and d.hub_id is None:
            return [(f"the hub's {self.name}", list(self.hub_columns))]
        return [(str(f), list(header(str(f), f.stat().st_size, f.stat().st_mtime_ns))) for f in files]
