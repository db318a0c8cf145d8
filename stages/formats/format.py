"""What an export format is (`export.formats`, one module of stages/formats each, registered in FORMATS in
stages/formats/__init__.py): its plan-time check, its write (each file checked in its runtime against the
exported model, the reload comparison, before anything is committed), its lines of the model card and the
libraries its files depend on (in the export stage's key). The export stage (stages/export.py) and the plan
(stages/graph.py) iterate FORMATS and never branch on a format's name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.engine.errors import ConfigError


@dataclass(frozen=True)
class ExportJob:
    """What a format writes from: the run's config, the export folder being written (its top already holds the
    Hugging Face model and tokenizer when a format beside it writes), the upstream stages' folders."""

    cfg: Any
    out: Path
    layout: str  # what sits at the top (stages/formats/export_layout.py top_layout): model, adapter or merged
    upstream: Mapping[str, Path]
    revision: str | None  # the commit the hub base was pinned to (None: not a hub base)
    tok: Any  # the tokenizer the export ships (already saved at the top)
    gen: Any  # the generation config (None for a method that does not generate)
    log: Any

    @property
    def merged_at(self) -> Path:
        """The folder holding the merged (or fully finetuned) weights: the top, or merged/ beside an adapter."""
        return self.out if self.layout in ("merged", "model") else self.out / "merged"


class Format:
    """One export format. `folder`: its folder in the export ('' : the top of it)."""

    name: str = ""
    folder: str = ""
    from_merged: bool = True  # written from merged weights: an adapter at the top needs export.merge
    libraries: tuple[str, ...] = ()  # distributions its files depend on (the export stage's key)

    def check(self, cfg: Any) -> None:
        """Plan time, when export.formats lists it: it can be written for this pipeline."""
        x = cfg.export
        if self.from_merged and cfg.adapters.method == "lora" and x.layout == "adapter" and not x.merge:
            raise ConfigError(f"export.formats {self.name}: written from merged weights, and export.layout adapter "
                              f"writes the adapter alone; set export.merge=true (or export.layout merged or auto)")

    def check_unlisted(self, cfg: Any) -> None:
        """Plan time, when export.formats does not list it: none of its own settings is set."""

    def write(self, job: ExportJob) -> dict[str, Any]:
        """Write its files into job.out, each checked in its runtime; the facts for the manifest."""
        raise NotImplementedError

    def card_lines(self, job: ExportJob, facts: dict[str, Any]) -> dict[str, str]:
        """{folder: what it holds} for the model card's Files section."""
        return {self.folder: ""} if self.folder else {}
