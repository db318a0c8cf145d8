"""Sources, export formats and runtimes are registries (stages/sources, stages/formats, stages/runtimes): a new one
is an entry registered under its name, picked up by the schema, the plan and the stage that runs it with no
other edit; an unknown name is one line listing the choices (exit 2). No training here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from helpers import run

from stages import data, export
from stages.engine.errors import ConfigError, MissingInputError
from stages.formats import FORMATS, check_formats
from stages.formats.format import ExportJob, Format
from stages.pipeline.loading import load_pipeline
from stages.runtimes import RUNTIMES
from stages.sources import SOURCES
from stages.sources.source import Source


class Reviews(Source):
    """A source of six rows, its labels named."""

    name = "fake-reviews"
    label_names = ["bad", "good"]

    def files(self, d: Any) -> list[Path]:
        return []

    def read(self, d: Any) -> tuple[dict[str, pd.DataFrame], str]:
        rows = pd.DataFrame({"text": [f"review {i}" for i in range(6)], "label": ["good", "bad"] * 3})
        return {"train": rows.iloc[:4], "test": rows.iloc[4:]}, "fake:reviews"

    def splits(self, d: Any) -> set[str]:
        return {"train", "test"}

    def headers(self, d: Any) -> list[tuple[str, list[str]]]:
        return [("fake reviews", ["text", "label"])]


class Text(Format):
    """A format that writes the model's name as text, refused for a seq2seq model."""

    name, folder, from_merged = "fake-text", "text", False

    def check(self, cfg: Any) -> None:
        if cfg.method.name == "seq2seq":
            raise ConfigError("export.formats fake-text: not for seq2seq")

    def write(self, job: ExportJob) -> dict[str, Any]:
        (job.out / self.folder).mkdir()
        (job.out / self.folder / "model.txt").write_text(job.cfg.model.name)
        return {"file": f"{self.folder}/model.txt"}

    def card_lines(self, job: ExportJob, facts: dict[str, Any]) -> dict[str, str]:
        return {self.folder: f"`{facts['file']}`: the model's name"}


class Top(Format):
    """The hf format's stand-in: the folder's top as the weights would leave it."""

    name, from_merged = "hf", False

    def write(self, job: ExportJob) -> dict[str, Any]:
        return {"dtype": "float32"}


def test_a_registered_source_is_read_by_name_through_the_data_stage(store_dir, monkeypatch):
    monkeypatch.setitem(SOURCES, Reviews.name, Reviews())
    sets = ["data.source=fake-reviews", "data.split={mode: source, seed: 1, validation: 1}", "data.subset=null",
            "model.num_labels=null"]
    cfg = data.resolve_labels(load_pipeline("tiny-imdb", sets))  # its label names fill data.label_names
    assert cfg.data.label_names == ["bad", "good"] and cfg.model.num_labels == 2
    data.check_rows(cfg)  # plan time: its header has the columns data.* names
    assert data.makes_validation(cfg) and data.source_files(cfg) == [] and data.source_deps(cfg) == {}
    with pytest.raises(MissingInputError, match=r"^fake reviews: no column 'body' \(columns: text, label\)"):
        data.check_rows(load_pipeline("tiny-imdb", [*sets, "data.text_column=body"]))
    done = run("tiny-imdb", *sets, until="data")["data"]  # planned, keyed and run through the store
    stats = done.manifest["metrics"]
    assert stats["source"] == "fake:reviews" and stats["rows"] == {"train": 3, "validation": 1, "test": 2}
    assert stats["labels"]["test"] == {"0": 1, "1": 1}  # bad 0, good 1
    assert sorted(p.name for p in done.path.glob("*.arrow")) == ["test.arrow", "train.arrow", "validation.arrow"]


def test_a_registered_format_is_checked_at_plan_time_and_written_by_the_export(tmp_path, monkeypatch):
    monkeypatch.setitem(FORMATS, Top.name, Top())
    monkeypatch.setitem(FORMATS, Text.name, Text())
    cfg = load_pipeline("tiny-imdb", ["export.formats=[hf, fake-text]"])
    check_formats(cfg)
    with pytest.raises(ConfigError, match="^export.formats fake-text: not for seq2seq$"):
        check_formats(load_pipeline("tiny-billsum", ["export.formats=[hf, fake-text]"]))
    facts, lines = export.write_formats(ExportJob(cfg, tmp_path, "merged", {}, None, None, None, None))
    assert (tmp_path / "text" / "model.txt").read_text() == "tiny-bloom"
    assert facts == {"dtype": "float32", "fake-text": {"file": "text/model.txt"}}
    assert lines == {"text": "`text/model.txt`: the model's name"}
    assert "fake-text" not in load_pipeline("tiny-imdb").export.formats  # listed only where a pipeline lists it


@pytest.mark.parametrize("setting,registry", [("data.source", "SOURCES"), ("export.formats", "FORMATS")])
def test_an_unknown_name_is_one_line_with_the_choices_exit_2(setting, registry, store_dir, capsys):
    from stages.__main__ import main

    value = "nope" if setting == "data.source" else "[hf, nope]"
    assert main(["tiny-imdb", "--set", f"{setting}={value}"]) == 2
    err = capsys.readouterr().err
    names = ", ".join(SOURCES if registry == "SOURCES" else FORMATS)
    assert err.count("\n") == 1 and f"'nope' is not one of {names}" in err and registry in err, err
    assert not (store_dir / "objects").exists()


def test_the_registries_name_every_entry_under_its_own_name():
    for registry in (SOURCES, FORMATS, RUNTIMES):
        assert all(entry.name == name for name, entry in registry.items())
    assert list(FORMATS)[0] == "hf"  # written first: the others are written from its folder
