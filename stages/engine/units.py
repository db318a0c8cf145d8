"""Byte counts for people: the one formatter of sizes in messages, logs and tables (footprints, free
memory, artifact sizes). Decimal units with three significant digits, like the figures in docs/results.md and the
articles (11.4 GB -> 4.29 GB)."""

from __future__ import annotations

UNITS = ("B", "kB", "MB", "GB", "TB")


def human_bytes(n: float | None) -> str:
    """`512 B`, `1.05 MB`, `90.9 MB`, `4.29 GB`; `-` for None (size unknown)."""
    if n is None:
        return "-"
    value = float(n)
    if abs(value) < 999.5:
        return f"{value:.0f} B"
    for unit in UNITS[1:-1]:
        value /= 1000
        if abs(value) < 999.5:
            return f"{value:#.3g}".rstrip(".") + f" {unit}"
    value /= 1000
    return f"{value:#.3g}".rstrip(".") + " TB" if abs(value) < 999.5 else f"{value:,.0f} TB"
