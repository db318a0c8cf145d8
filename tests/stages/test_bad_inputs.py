"""Bad inputs a practitioner meets are one line naming the file (and line) and the fix, exit 2, before the
store is created: empty and broken data files, wrong encodings, symlink loops, a model folder of pickles."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from stages.__main__ import main as main_plain

SPLIT = "split: {mode: shuffle_concat, seed: 1, train: 1, validation: 1, test: 1}, subset: null"


# case -> (file name, its bytes, the line's words); the symlink cases are made in make_data
FILES = {
    "empty": ("d.csv", b"", "d.csv: empty file; give a file with a header line (CSV) or rows"),
    "broken-jsonl": ("d.jsonl", b'{"text": "a", "label": 0}\n{"text": "b", "label": 1\n',
                     "d.jsonl: line 2 is not valid JSON (Expecting ',' delimiter); fix or remove that line"),
    "latin1": ("d.csv", b"text,label\ngood,1\ncaf\xe9,0\n",
               "d.csv: line 3 is not UTF-8 (byte 0xe9); save the file as UTF-8, e.g. iconv -f latin1"),
    "gzip-that-is-not": ("d.csv.gz", b"text,label\na,1\n", "d.csv.gz: cannot be read ("),
    # pandas alone would make 'fine' the index and shift the columns: ' really' the text, 1 nobody's label
    "unquoted-comma": ("d.csv", b"text,label\nfine, really,1\nok,0\n", "d.csv: line 2 has 3 fields but the header "
                       "2; quote a field that holds a comma, or remove the extra one"),
    "jsonl-of-strings": ("d.jsonl", b'"good"\n"bad"\n', "d.jsonl: line 1 is a JSON str, not an object; give one "
                         "object per line"),
}


def make_data(tmp_path, case):
    if case in FILES:
        name, content, message = FILES[case]
        (tmp_path / name).write_bytes(content)
        return name, message
    if case == "symlink-loop":
        os.symlink(tmp_path / "b.csv", tmp_path / "d.csv")
        os.symlink(tmp_path / "d.csv", tmp_path / "b.csv")
        return "d.csv", "d.csv: a symlink loop; give an existing CSV/TSV/JSONL/JSON/Parquet file"
    os.symlink(tmp_path / "gone.csv", tmp_path / "d.csv")  # broken-symlink
    return "d.csv", f"d.csv: a broken symlink (to {tmp_path / 'gone.csv'}, which does not exist)"


@pytest.mark.parametrize("case", [*FILES, "symlink-loop", "broken-symlink"])
def test_a_bad_data_file_is_one_line_exit_2_nothing_written(tmp_path, monkeypatch, capsys, case):
    name, message = make_data(tmp_path, case)
    (tmp_path / "p.yaml").write_text(f"pipelines:\n  p:\n    extends: tiny-imdb\n    data: {{source: local, "
                                     f"path: {tmp_path / name}, {SPLIT}}}\n")
    monkeypatch.setenv("FINETUNE_STORE", str(tmp_path / "store"))
    assert main_plain(["p", "--config", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("weights,message", [
    ("pytorch_model.bin", "its weights are pickles (pytorch_model.bin), which are never loaded here (unpickling "
                          "can run code); convert them to safetensors"),
    (None, "no weights (*.safetensors) in the folder; give a folder saved with save_pretrained"),
], ids=["pickle-only", "no-weights"])
def test_a_model_folder_without_safetensors_is_one_line_at_plan_time(tmp_path, monkeypatch, capsys, weights,
                                                                      message):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 30522}))
    if weights:
        (folder / weights).write_bytes(pickle.dumps({"w": 1}))
    (tmp_path / "p.yaml").write_text(f"pipelines:\n  p:\n    extends: tiny-imdb\n    model: {{name: {folder}, "
                                     f"from_config: null}}\n")
    monkeypatch.setenv("FINETUNE_STORE", str(tmp_path / "store"))
    assert main_plain(["p", "--config", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: model.name {folder}: {message}" + err[0].split(message, 1)[-1]], err
    assert not (tmp_path / "store").exists()
