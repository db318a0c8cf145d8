"""The one byte formatter: decimal units, three significant digits (docs/results.md's and the articles' figures)."""

from __future__ import annotations

import pytest

from stages.engine.units import human_bytes


@pytest.mark.parametrize("n,text", [
    (None, "-"), (0, "0 B"), (999, "999 B"), (999.7, "1.00 kB"), (1_048_576, "1.05 MB"),
    (90_900_000, "90.9 MB"), (999_499_999, "999 MB"), (4_293_910_528, "4.29 GB"),  # the article's NF4 t5-3b
    (11_406_393_344, "11.4 GB"), (-2048, "-2.05 kB"), (1.2e12, "1.20 TB"), (5e15, "5,000 TB"),
])
def test_human_bytes(n, text):
    assert human_bytes(n) == text
