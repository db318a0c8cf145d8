"""model.trust_remote_code: a model folder that asks to run its own Python is refused at plan time while the
flag is off (one line naming it, none of the folder's code run, nothing written), and announced by a warning
line, naming the files, every time it is on."""

from __future__ import annotations

import json
import logging

import pytest

from stages.__main__ import main as main_plain
from stages.models.hf import check_remote_code
from stages.pipeline.loading import load_pipeline


@pytest.fixture
def custom_model(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "my-arch", "hidden_size": 8,
        "auto_map": {"AutoConfig": "configuration_my.MyConfig",
                     "AutoModelForSequenceClassification": "modeling_my.MyModel"}}))
    marker = tmp_path / "code-ran"
    for name in ("configuration_my.py", "modeling_my.py"):
        (folder / name).write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return folder, marker


def pipeline_file(tmp_path, folder, trust: bool):
    path = tmp_path / "mine.yaml"
    path.write_text(f"pipelines:\n  mine:\n    extends: tiny-imdb\n    model: {{name: {folder}, from_config: null, "
                    f"trust_remote_code: {str(trust).lower()}}}\n")
    return path


def test_a_custom_code_model_with_trust_off_is_one_line_at_plan_time_and_runs_nothing(tmp_path, custom_model,
                                                                                       capsys, monkeypatch):
    folder, marker = custom_model
    monkeypatch.setenv("FINETUNE_STORE", str(tmp_path / "store"))
    code = main_plain(["mine", "--config", str(pipeline_file(tmp_path, folder, trust=False))])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        f"error: model.name {folder}: its config.json asks to run its own Python (configuration_my.py, "
        f"modeling_my.py; model type 'my-arch' is not in transformers); set model.trust_remote_code: true if you "
        f"trust that code (it runs in this process)"], err
    assert not marker.exists() and not (tmp_path / "store").exists()


def test_trust_on_is_announced_with_the_files_that_will_run(tmp_path, custom_model, caplog):
    folder, _ = custom_model
    cfg = load_pipeline("mine", path=pipeline_file(tmp_path, folder, trust=True))
    with caplog.at_level(logging.WARNING, logger="finetune"):
        check_remote_code(cfg)
        check_remote_code(cfg)
    assert [r.getMessage() for r in caplog.records] == [
        f"model.trust_remote_code is on: {folder}'s Python files (configuration_my.py, modeling_my.py) will run in "
        f"this process, with your permissions"] * 2


def test_a_model_transformers_knows_needs_no_trust_even_with_an_auto_map(tmp_path, custom_model, caplog):
    folder, marker = custom_model
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with caplog.at_level(logging.WARNING, logger="finetune"):
        check_remote_code(load_pipeline("mine", path=pipeline_file(tmp_path, folder, trust=False)))
    assert not caplog.records and not marker.exists()


def test_a_custom_code_hub_model_in_the_hf_cache_is_refused_at_plan_time_too(tmp_path, custom_model, capsys,
                                                                             monkeypatch):
    """A hub id is checked from its config.json in the HF cache (or fetched alone when the hub answers), before
    transformers loads it: the same line, naming the repo."""
    import huggingface_hub.constants

    folder, marker = custom_model
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "models--acme--my-model"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("FINETUNE_STORE", str(tmp_path / "store"))
    code = main_plain(["mine", "--config", str(pipeline_file(tmp_path, "acme/my-model", trust=False))])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "error: model.name acme/my-model (hub): its config.json asks to run its own Python (configuration_my.py, "
        "modeling_my.py; model type 'my-arch' is not in transformers); set model.trust_remote_code: true if you "
        "trust that code (it runs in this process)"], err
    assert not marker.exists() and not (tmp_path / "store").exists()
