"""How values read in the reports' text, tables and markdown: numbers, labels, times, tables, inlined charts."""

from __future__ import annotations

import base64
import json
from datetime import datetime
from pathlib import Path
from typing import Any

INLINE_PNG_MAX_BYTES = 300_000  # a larger chart is linked by its path only


def number(v: Any) -> str:
    """A metric as a table shows it: floats to 4 significant digits, anything else as is."""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def label(value: Any) -> str:
    """A parameter value as it reads in a variant's label or a table: 0.0001, 16, [test], {train: 64}."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":")).replace('"', "")
    return str(value)


def local_time(iso: str | None) -> str:
    if not iso:
        return "-"
    try:
        return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return iso


def render_table(rows: list[list[str]]) -> str:
    """Rows of cells (the first the header) in left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def markdown_table(rows: list[list[str]]) -> str:
    """Rows of cells (the first the header) as a Markdown table (the benches' printed tables)."""
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join([lines[0], "|" + "---|" * len(rows[0]), *lines[1:]])


def inline_png(png: Path, alt: str) -> list[str]:
    """Markdown lines showing a PNG inline (a data URL, for the Prefect UI), unless missing or too large."""
    if not png.is_file() or png.stat().st_size >= INLINE_PNG_MAX_BYTES:
        return []
    return [f"![{alt}](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()})", ""]
