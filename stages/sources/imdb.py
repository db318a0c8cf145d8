"""data.source imdb: 50,000 movie reviews (stanfordnlp/imdb), labels 0 neg / 1 pos, read from the offline mirror's
imdb/{test,train}.csv.gz when it has them, else the hub (its rows put in the mirror's order: aclImdb's,
positives first within each split)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.sources.source import Frames, HubSource, mirror_root
from stages.sources.tables import read_table

LABEL_NAMES = ["neg", "pos"]  # aclImdb's folder names: label 0 is neg, 1 is pos


class Imdb(HubSource):
    name = "imdb"
    hub_id = "stanfordnlp/imdb"
    hub_columns = ("text", "label")
    label_names = LABEL_NAMES
    mirror_layout = "imdb/{train,test}.csv.gz"

    def mirror_files(self, d: Any) -> list[Path]:
        root = mirror_root(d)
        if root is None:
            return []
        files = [root / "imdb" / "test.csv.gz", root / "imdb" / "train.csv.gz"]
        return files if all(f.is_file() for f in files) else []

    def read_mirror(self, files: list[Path]) -> Frames:
        return {"test": read_table(files[0]), "train": read_table(files[1])}

    def order(self, frames: Frames) -> Frames:
        return {s: f.sort_values("label", ascending=False, kind="stable").reset_index(drop=True)
                for s, f in frames.items()}


SOURCE = Imdb()
