"""data.source billsum: US bills with their summaries (seq2seq; target column `summary`), read from the offline
mirror's billsum/*.jsonl when it has them, else the hub."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.sources.source import HubSource, mirror_root


class Billsum(HubSource):
    name = "billsum"
    hub_id = "billsum"
    hub_columns = ("text", "summary", "title")
    target_column = "summary"
    mirror_layout = "billsum/*.jsonl"

    def mirror_files(self, d: Any) -> list[Path]:
        root = mirror_root(d)
        return [] if root is None else sorted((root / "billsum").glob("*.jsonl"))


SOURCE = Billsum()
