"""Export formats, by the name `export.formats` lists (stages/formats/format.py says what a format owns). A new
format is one module here whose FORMAT is added to FORMATS below; the schema validates export.formats against
FORMATS, the plan runs each one's check, the export stage its write, in this order (hf first: the others are
written from its folder)."""

from __future__ import annotations

from typing import Any

from stages.formats import gguf_export, hf, onnx_export
from stages.formats.format import Format

FORMATS: dict[str, Format] = {f.name: f for f in (hf.FORMAT, onnx_export.FORMAT, gguf_export.FORMAT)}


def listed_formats(cfg: Any) -> list[Format]:
    """The formats export.formats lists, in FORMATS' order."""
    return [f for name, f in FORMATS.items() if name in cfg.export.formats]


def check_formats(cfg: Any) -> None:
    """Plan time: each listed format can be written for this pipeline; an unlisted one's settings are unset."""
    # those written beside the top first: their refusals name the format, before the top's layout check
    for f in sorted(FORMATS.values(), key=lambda f: not f.from_merged):
        if f.name in cfg.export.formats:
            f.check(cfg)
        else:
            f.check_unlisted(cfg)


def libraries() -> tuple[str, ...]:
    """Every format's libraries (the export stage's key), each once."""
    return tuple(dict.fromkeys(lib for f in FORMATS.values() for lib in f.libraries))
