"""Bad inputs a practitioner meets are one line naming the file (and line) and the fix, exit 2, before the
store is created: empty and broken data files, wrong encodings, symlink loops, a model folder whose config.json,
weights or tokenizer would not load (or would load a pickle)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

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


class Payload:
    """A pickle whose loading creates `marker`: the proof that a pickle was (or was never) loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def weights(path: Path) -> None:
    """A real (tiny) safetensors file: its header and its one tensor."""
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((4, 4), dtype=np.float32)}, str(path))


CONFIG = json.dumps({"model_type": "bert", "vocab_size": 30522})
VOCAB = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n"


def make_folder(folder: Path, case: str) -> None:
    """A model folder as a user may hand one over: config.json, weights, tokenizer files, each spoilt by `case`."""
    folder.mkdir()
    (folder / "config.json").write_text({"bad-config": '{"model_type": "bert",\n', "bad-config-no-weights": "{not json",
                                         "pickle-by-config": json.dumps({"model_type": "bert",
                                                                         "transformers_weights": "adapter_model.bin"})
                                         }.get(case, CONFIG))
    pickled = pickle.dumps(Payload(folder.parent / "unpickled"))
    if case in ("pickle-only", "decoy"):
        (folder / "pytorch_model.bin").write_bytes(pickled)
    if case == "decoy":  # any *.safetensors beside the pickle: transformers falls back to the pickle
        (folder / "decoy.safetensors").write_bytes(b"")
    if case == "pickle-by-config":
        (folder / "adapter_model.bin").write_bytes(pickled)
    if case == "pickle-shard":
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "pytorch_model.bin"}}))
        (folder / "pytorch_model.bin").write_bytes(pickled)
    if case in ("bad-config", "no-tokenizer", "only-specials", "broken-tokenizer", "pickle-by-config", "good",
                "truncated"):
        weights(folder / "model.safetensors")
    if case == "truncated":
        (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:-8])
    if case == "garbage":
        (folder / "model.safetensors").write_bytes(os.urandom(4096))
    if case in ("only-specials", "good"):
        (folder / "vocab.txt").write_text(VOCAB + ("good\nfilm\n" if case == "good" else ""))
    if case == "broken-tokenizer":
        (folder / "tokenizer.json").write_text("{}")


FOLDERS = {
    "pickle-only": "its weights are pickles (pytorch_model.bin), which are never loaded here (unpickling can run "
                   "code); convert them to safetensors",
    "no-weights": "no weights (*.safetensors) in the folder; give a folder saved with save_pretrained",
    "decoy": "its weights are pickles (pytorch_model.bin), which are never loaded here (unpickling can run code) "
             "(decoy.safetensors beside them is not model.safetensors); convert them to safetensors",
    "pickle-by-config": "config.json's transformers_weights names adapter_model.bin, not a safetensors file, which "
                        "are never loaded here",
    "pickle-shard": "model.safetensors.index.json names the shard pytorch_model.bin, not a safetensors file, which "
                    "are never loaded here",
    "bad-config": "config.json is not valid JSON (Expecting property name enclosed in double quotes: line 2 column 1); "
                  "fix it, or save the model again with save_pretrained",
    "bad-config-no-weights": "config.json is not valid JSON (Expecting property name enclosed in double quotes: line "
                             "1 column 2)",
    "garbage": "model.safetensors is not a readable safetensors file (header too large); remove it or save the "
               "model again",
    "truncated": "model.safetensors is not a readable safetensors file (incomplete metadata, file not fully covered)",
    "no-tokenizer": "no tokenizer files (tokenizer.json, vocab.txt, vocab.json, *.model) in the folder, so every "
                    "word would be read as unknown; copy the model's tokenizer files",
    "only-specials": "the vocabulary of vocab.txt is only its special tokens ([CLS], [MASK], [PAD], [SEP], [UNK]), "
                     "so every word would be read as unknown",
    "broken-tokenizer": "tokenizer.json cannot be read (",
}


def folder_pipeline(tmp_path: Path, folder: Path) -> Path:
    (tmp_path / "p.yaml").write_text(f"pipelines:\n  p:\n    extends: tiny-imdb\n    model: {{name: {folder}, "
                                     f"from_config: null}}\n    tokenize: {{tokenizer: null}}\n")
    return tmp_path / "p.yaml"


@pytest.mark.parametrize("case", list(FOLDERS))
def test_a_bad_model_folder_is_one_line_at_plan_time_and_no_pickle_is_loaded(tmp_path, monkeypatch, capsys, case):
    """model.name a local folder (its tokenizer too): config.json, the weights from_pretrained would read and every
    safetensors header, and a tokenizer with words, checked before anything runs; a pickle is never unpickled."""
    folder = tmp_path / "model"
    make_folder(folder, case)
    monkeypatch.setenv("FINETUNE_STORE", str(tmp_path / "store"))
    assert main_plain(["p", "--config", str(folder_pipeline(tmp_path, folder))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: model.name {folder}: {FOLDERS[case]}"), err
    assert not (tmp_path / "store").exists() and not (tmp_path / "unpickled").exists()


def test_a_sound_model_folder_passes_the_same_checks(tmp_path):
    """The control: config.json, model.safetensors and a vocabulary with words plan (no stage runs)."""
    from stages.graph import GRAPH
    from stages.pipeline.loading import load_pipeline

    folder = tmp_path / "model"
    make_folder(folder, "good")
    cfg = load_pipeline("p", [], folder_pipeline(tmp_path, folder))
    assert GRAPH.validate(cfg).model.name == str(folder)


@pytest.mark.parametrize("case", ["no-tokenizer", "decoy"])
def test_the_no_tokenizer_and_decoy_folders_are_refused_within_5_s_before_prefect(tmp_path, case):
    """Through the Prefect entry point: one line, exit 2, in under 5 s, with no Prefect home and no store."""
    import subprocess
    import sys
    import time

    from helpers import ROOT, subprocess_env

    folder = tmp_path / "model"
    make_folder(folder, case)
    env = subprocess_env(tmp_path / "store", PREFECT_HOME=str(tmp_path / "prefect"), PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "flows.finetune", "p", "--config", str(folder_pipeline(tmp_path, folder))],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert (p.returncode, p.stdout) == (2, "") and p.stderr.startswith(f"error: model.name {folder}: {FOLDERS[case]}")
    assert len(p.stderr.strip().splitlines()) == 1 and took < 5, (took, p.stderr)
    assert not (tmp_path / "store").exists() and not (tmp_path / "prefect").exists()
    assert not (tmp_path / "unpickled").exists()


def test_a_tokenizer_folder_of_special_tokens_alone_is_refused_naming_tokenize_tokenizer(tmp_path, monkeypatch,
                                                                                         capsys):
    """tokenize.tokenizer a folder of its own (a random model from model.from_config): its vocabulary is checked
    the same way, and the line names the setting."""
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "vocab.txt").write_text(VOCAB)
    (tmp_path / "p.yaml").write_text(f"pipelines:\n  p:\n    extends: tiny-imdb\n    tokenize: {{tokenizer: {folder}}}\n")
    monkeypatch.setenv("FINETUNE_STORE", str(tmp_path / "store"))
    assert main_plain(["p", "--config", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: tokenize.tokenizer {folder}: the vocabulary of vocab.txt is only its special tokens "
                   f"([CLS], [MASK], [PAD], [SEP], [UNK]), so every word would be read as unknown; copy the model's "
                   f"tokenizer files (tokenizer.json, or vocab.txt / vocab.json and merges.txt, or a sentencepiece "
                   f"*.model) into the folder, or set tokenize.tokenizer to a folder, hub id or pkg: path that has "
                   f"them"], err
    assert not (tmp_path / "store").exists()
