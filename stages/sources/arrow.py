"""Splits as Arrow IPC files: how the data stage writes them and every later stage reads them."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa


def write_arrow(df: pd.DataFrame, path: Path) -> None:
    table = pa.Table.from_pandas(df, preserve_index=False).replace_schema_metadata(None)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def read_split(folder: Path, split_name: str) -> pa.Table:
    with pa.memory_map(str(folder / f"{split_name}.arrow")) as src:
        return pa.ipc.open_file(src).read_all()
