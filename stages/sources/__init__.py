"""Data sources, by the name `data.source` gives (stages/sources/source.py says what a source owns). A new source
is one module here whose SOURCE is added to SOURCES below; the schema validates data.source against SOURCES
and the configuration reference lists its names."""

from __future__ import annotations

from typing import Any

from stages.sources import billsum, imdb, local
from stages.sources.source import Source

SOURCES: dict[str, Source] = {s.name: s for s in (imdb.SOURCE, billsum.SOURCE, local.SOURCE)}


def source_of(d: Any) -> Source:
    """The source the data stage reads for data section `d`: a data.path set is read whatever data.source says."""
    return local.SOURCE if d.path else SOURCES[d.source]
