"""`python -m flows.predict`: an export folder or a pipeline's current export on --text / --file, labels with
probabilities or generated text equal to the evaluate stage's predictions; a missing or stale export and bad
input are one line, exit 2."""

from __future__ import annotations

import csv
import json
import shutil

import helpers
import pytest
from helpers import BILLSUM, IMDB, needs_shared_data
from safetensors.torch import load_file, save_file

from flows.predict import main
from stages.sources.arrow import read_split

pytestmark = needs_shared_data


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("predict-store")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FINETUNE_STORE", str(root))
        yield {"imdb": helpers.run("tiny-imdb", *IMDB), "billsum": helpers.run("tiny-billsum", *BILLSUM)}


def evaluated(out: dict) -> tuple[list[str], list]:
    recs = [json.loads(ln) for ln in (out["evaluate"].path / "predictions.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["split"] == "test"]
    table = read_split(out["data"].path, "test")
    text = dict(zip([str(i) for i in table.column("id").to_pylist()], table.column("text").to_pylist(), strict=True))
    return [text[r["id"]] for r in recs], [r["prediction"] for r in recs]


def test_a_csv_file_gives_the_evaluated_labels_with_probabilities(runs, tmp_path, capsys):
    texts, expected = evaluated(runs["imdb"])
    src = tmp_path / "reviews.csv"
    with open(src, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "review"])
        w.writerows(enumerate(texts))
    out = tmp_path / "p.jsonl"
    folder = str(runs["imdb"]["export"].path)
    assert main([folder, "--file", str(src), "--text-column", "review", "--out", str(out), "--batch-size", "3"]) == 0
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["text"] for r in recs] == texts  # file order, though batches run longest first
    assert [r["label"] for r in recs] == expected
    for r in recs:
        assert abs(sum(r["probabilities"].values()) - 1) < 1e-4 and r["probability"] == max(r["probabilities"].values())
    assert f"{len(texts)} texts -> {out}" in capsys.readouterr().out


def test_a_parquet_file_gives_the_same_labels_as_the_evaluate_stage(runs, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts, expected = evaluated(runs["imdb"])
    src = tmp_path / "reviews.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "review": texts}), src)
    out = tmp_path / "p.jsonl"
    assert main([str(runs["imdb"]["export"].path), "--file", str(src), "--text-column", "review", "--out", str(out)]) == 0
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["text"] for r in recs] == texts and [r["label"] for r in recs] == expected


def test_a_pipeline_name_uses_its_current_export_and_generates_the_evaluated_text(runs, monkeypatch, capsys):
    monkeypatch.setenv("FINETUNE_STORE", str(runs["billsum"]["export"].path.parents[1]))
    texts, expected = evaluated(runs["billsum"])
    sets = [a for s in BILLSUM for a in ("--set", s)]
    assert main(["tiny-billsum", *sets, "--text", texts[0], "--text", texts[1]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.removeprefix("  -> ") for ln in lines[1::2]] == expected[:2]

    # another config: its export is not in the store -> one line naming the command that makes it
    assert main(["tiny-billsum", *sets, "--set", "train.lr=0.5", "--text", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert "no current export (stale: changed params: overrides, train.lr;" in err
    assert err.endswith("make it with: finetune run tiny-billsum --set train.max_steps=2 --set "
                        "evaluate.max_new_tokens=8 --set train.lr=0.5")
    assert main(["tiny-billsum", "--set", "train.max_steps=1", "--text", "x"]) == 2
    assert "no current export (" in capsys.readouterr().err


def test_predict_computes_in_the_precision_the_export_was_evaluated_in(runs, tmp_path, monkeypatch, caplog):
    """Default `--precision export`: the run's resolved train.mixed_precision, not this machine's auto, so a
    machine with bf16 units reproduces an export evaluated in fp32 (and the other way round); `auto` is this
    machine's choice."""
    import logging
    import shutil

    texts, expected = evaluated(runs["imdb"])
    folder = runs["imdb"]["export"].path
    monkeypatch.setenv("FINETUNE_CPU_BF16_UNITS", "avx512_bf16")  # this machine: bf16 units
    out = tmp_path / "p.jsonl"

    def chosen(*argv: str) -> str:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="finetune.predict"):
            assert main([*argv, "--text", texts[0], "--text", texts[1], "--out", str(out)]) == 0
        return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("predict: device"))

    assert chosen(str(folder)) == ("predict: device cpu, precision no (as the export was evaluated "
                                   "(train.mixed_precision no))")
    assert [json.loads(ln)["label"] for ln in out.read_text().splitlines()] == expected[:2]
    assert "precision bf16 (auto: the CPU has bf16 units (avx512_bf16))" in chosen(str(folder), "--precision", "auto")

    bf16 = tmp_path / "bf16-export"
    shutil.copytree(folder, bf16)
    settings = json.loads((bf16 / "finetune_pipeline.json").read_text())
    settings["train"]["mixed_precision"] = "bf16"
    (bf16 / "finetune_pipeline.json").write_text(json.dumps(settings))
    monkeypatch.setenv("FINETUNE_CPU_BF16_UNITS", "")  # a machine without them still computes as evaluated
    assert "precision bf16 (as the export was evaluated (train.mixed_precision bf16))" in chosen(str(bf16))


@pytest.mark.parametrize("content,name,argv,message", [
    ("id,body\n1,good\n", "a.csv", [], "no column 'text' (it has id, body); pass --text-column"),
    ("", "a.csv", [], "a.csv: empty file; give a file with a header line (CSV) or rows"),
    ('{"text": "ok"}\n{"text": ""}\n', "a.jsonl", [], "a.jsonl: line 2, column 'text': empty (1 such row); fill"),
    ("PAR1 cut short", "a.parquet", [], "not a readable Parquet file"),
    ("a b c\n", "a.txt", [], "a.txt: not a .csv, .csv.gz, .tsv, .tsv.gz, .jsonl, .jsonl.gz, .json or .parquet file"),
    (None, None, ["--text", "x"], "not an export folder"),
    (None, None, [], "nothing to predict"),
], ids=["no-text-column", "empty-file", "empty-text", "bad-parquet", "unknown-type", "not-an-export", "no-input"])
def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, capsys, content, name, argv, message):
    target = str(runs["imdb"]["export"].path)
    if content is not None:
        (tmp_path / name).write_text(content)
        argv = ["--file", str(tmp_path / name)]
    elif message == "not an export folder":
        target = str(tmp_path)
    assert main([target, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err


# case -> (file name, its bytes, the words of the line); None: made in the test
BAD_FILES = {
    "binary": ("a.csv", bytes(range(256)) * 4, "a.csv: a binary file (NUL bytes), not text; give a CSV, TSV or JSONL"),
    "latin1": ("a.csv", b"text\ngood\ncaf\xe9\n", "a.csv: line 3 is not UTF-8 (byte 0xe9); save the file as UTF-8, "
               "e.g. iconv -f latin1 -t utf-8 a.csv > utf8-a.csv"),
    "utf16": ("a.csv", "text\ngood\n".encode("utf-16"), "a.csv: UTF-16 text; save the file as UTF-8, e.g. iconv -f "
              "utf-16"),
    "20MB-field": ("a.csv", b'text\nshort\n"' + b"x" * 20_000_000 + b'"\n', "a.csv: line 3, column 'text': "
                   "20,000,000 characters, more than the 1,000,000 predict takes"),
    "quote-never-closed": ("a.csv", b'text\nfine\n"never closed\nmore\n', "a.csv: cannot be parsed (Error "
                           "tokenizing data. C error: EOF inside string"),
    "gzip-that-is-not": ("a.csv.gz", b"text\ngood\n", "a.csv.gz: cannot be read (not gzip: Not a gzipped file "
                         "(b'te')); compress it with gzip, or drop .gz from its name"),
    "header-only": ("a.csv", b"text\n", "a.csv: no rows; give a file with one text"),
    "empty-after-two-line-text": ("a.csv", b'text\n"two\nlines"\n\n""\n', "a.csv: line 5, column 'text': empty (1 "
                                  "such row); fill or remove those rows"),  # lines counted as in an editor
    "unquoted-comma": ("a.csv", b"text\nfine, really\n", "a.csv: line 2 has 2 fields but the header 1; quote a field "
                       "that holds a comma"),
    "jsonl-of-arrays": ("a.jsonl", b'{"text": "good"}\n["bad"]\n', "a.jsonl: line 2 is a JSON list, not an object"),
    "tsv-wrong-column": ("a.tsv", b"id\tbody\n1\tgood\n", "a.tsv: no column 'text' (it has id, body); pass "
                         "--text-column"),
    "list-for-text": ("a.jsonl", b'{"text": "good"}\n\n{"text": ["a", "b"]}\n', "a.jsonl: line 3, column 'text': holds "
                      "a list, not text; for a chat export's conversations pass --messages-column text"),
    "json-object": ("a.json", b'{"text": "good"}', "a.json: a JSON dict, not an array of objects; give "
                    '[{"text": ...}, ...]'),
    "json-values": ("a.json", b"[1, 2]", "a.json: a JSON array of values, not of objects"),
    "json-lines-named-json": ("a.json", b'{"text": "a"}\n{"text": "b"}\n', "a.json: not valid JSON (Extra data, "
                              "line 2); a .json file holds one array of objects"),
    "folder": (None, None, "a.csv: a folder; give a CSV, TSV or JSONL file (.gz too), a JSON array of objects"),
    "no-such-file": (None, None, "a.csv: no such file or folder; give a CSV"),
    "unreadable": ("a.csv", b"text\ngood\n", "a.csv: cannot be read (permission denied); make it readable, e.g. "
                   "chmod u+r"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_file_is_one_line_naming_it_and_the_fix_exit_2(runs, tmp_path, capsys, monkeypatch, case):
    import builtins
    import errno
    import os

    name, content, message = BAD_FILES[case]
    path = tmp_path / (name or "a.csv")
    if content is not None:
        path.write_bytes(content)
    elif case == "folder":
        path.mkdir()
    if case == "unreadable":
        path.chmod(0)
        if os.geteuid() == 0:  # root reads any file: refuse it as the OS refuses anyone else
            real_open = builtins.open

            def refusing_open(file, *args, **kwargs):
                if str(file) == str(path):
                    raise PermissionError(errno.EACCES, "Permission denied", str(file))
                return real_open(file, *args, **kwargs)

            monkeypatch.setattr(builtins, "open", refusing_open)
    assert main([str(runs["imdb"]["export"].path), "--file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: --file {tmp_path}/") and message in err, err


@pytest.mark.parametrize("argv,message", [
    (["--text", "good", "--text", "caf\udce9"], "--text #2: byte 0xe9 is not UTF-8 (character 4); give the text as "
     "UTF-8"),
    (["--chat", "\ud800"], "--chat: U+D800 is a lone surrogate, not a character (character 1)"),
    (["--text", "good", "--out", "{tmp}"], "--out {tmp}: a folder; give a file name"),
    (["--text", "good", "--out", "{tmp}/f/p.jsonl"], "--out {tmp}/f/p.jsonl: {tmp}/f is a file, not a folder"),
    (["--text", "good", "--max-new-tokens", "0"], "--max-new-tokens: must be at least 1, got 0"),
    (["--text", "good", "--num-beams", "-1"], "--num-beams: must be at least 1, got -1"),
], ids=["text-not-utf8", "chat-lone-surrogate", "out-a-folder", "out-under-a-file", "no-new-tokens", "no-beams"])
def test_a_bad_argument_is_one_line_before_the_model_loads_exit_2(runs, tmp_path, capsys, argv, message):
    """Bytes that are not UTF-8 on the command line reach Python as surrogate escapes (\\udcXX)."""
    (tmp_path / "f").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main([str(runs["imdb"]["export"].path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message.replace("{tmp}", str(tmp_path)) in err, err


def test_bytes_that_are_not_utf8_on_the_command_line_are_one_line_exit_2(runs, tmp_path):
    """The command itself, given the bytes (a latin-1 shell): one line, exit 2, no traceback; a latin-1 file
    the same."""
    import os
    import subprocess
    import sys

    export = os.fsencode(runs["imdb"]["export"].path)
    (tmp_path / "a.csv").write_bytes(b"text\ncaf\xe9\n")
    for argv, line in [([b"--text", b"caf\xe9"], "error: --text: byte 0xe9 is not UTF-8 (character 4); give the text "
                        "as UTF-8"),
                       ([b"--file", os.fsencode(tmp_path / "a.csv")], f"error: --file {tmp_path / 'a.csv'}: line 2 is "
                        f"not UTF-8 (byte 0xe9); save the file as UTF-8")]:
        r = subprocess.run([os.fsencode(sys.executable), b"-m", b"flows.predict", export, *argv], cwd=helpers.ROOT,
                           capture_output=True, text=True, errors="backslashreplace", timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith(line), r.stderr


@pytest.mark.parametrize("name", ["reviews.tsv", "reviews.json", "reviews.jsonl.gz"])
def test_every_format_the_data_stage_reads_gives_the_evaluated_labels(runs, tmp_path, name):
    """--file takes what data.path takes (stages/sources/tables.py), TSV and JSON arrays too."""
    import pandas as pd

    texts, expected = evaluated(runs["imdb"])
    src, frame = tmp_path / name, pd.DataFrame({"id": range(len(texts)), "review": texts})
    if name.endswith(".tsv"):
        frame.to_csv(src, sep="\t", index=False)
    else:
        frame.to_json(src, orient="records", lines=name.endswith(".jsonl.gz"))
    out = tmp_path / "p.jsonl"
    assert main([str(runs["imdb"]["export"].path), "--file", str(src), "--text-column", "review", "--out", str(out)]) == 0
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["text"] for r in recs] == texts and [r["label"] for r in recs] == expected


def damage(folder, case):
    import os

    if case == "garbage-weights":
        (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    elif case == "weights-cut-short":
        os.truncate(folder / "model.safetensors", (folder / "model.safetensors").stat().st_size // 2)
    elif case == "config-not-json":
        (folder / "config.json").write_text('{"model_type": ')
    elif case == "settings-without-tokenize":
        settings = json.loads((folder / "finetune_pipeline.json").read_text())
        del settings["tokenize"]
        (folder / "finetune_pipeline.json").write_text(json.dumps(settings))
    else:  # no-tokenizer
        for f in folder.glob("tokenizer*"):
            f.unlink()


@pytest.mark.parametrize("case,message", [
    ("garbage-weights", "model.safetensors is not a readable safetensors file (Error while deserializing header: "),
    ("weights-cut-short", "model.safetensors is not a readable safetensors file (Error while deserializing header: "
     "incomplete metadata, file not fully covered)"),
    ("config-not-json", "config.json cannot be read as JSON (Expecting value: line 1 column 16 (char 15))"),
    ("settings-without-tokenize", "finetune_pipeline.json is not an export's settings (no 'tokenize')"),
    ("no-tokenizer", "the folder has no tokenizer (none of tokenizer.json, "),
])
def test_a_damaged_export_folder_is_one_line_naming_the_file_exit_2(runs, tmp_path, capsys, case, message):
    folder = tmp_path / "export"
    shutil.copytree(runs["imdb"]["export"].path, folder)
    damage(folder, case)
    assert main([str(folder), "--text", "Great film."]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: export {folder}: {message}"), err
    assert err.endswith("; export the pipeline again (finetune inspect verify finds damaged artifacts in the store)")

    assert main([str(folder / "config.json"), "--text", "Great film."]) == 2  # a file, not the folder
    assert capsys.readouterr().err.strip() == (f"error: {folder / 'config.json'}: a file, not a folder; give a "
                                               f"pipeline name or an export folder")


def test_chat_on_a_classifier_export_is_one_line_exit_2(runs, capsys):
    assert main([str(runs["imdb"]["export"].path), "--chat", "Was it good?"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is a classify export (text-classification), not a chat model" in err, err


CONVERSATION = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("lines,message", [
    ([CONVERSATION, [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]],
     "line 3, field 'messages[1]': unknown role 'bot' (known: system, user, assistant); rename it to one of those "
     "in the file"),
    ([CONVERSATION, "Hi there"], "line 3, field 'messages': a str, not a list of turns"),
    ([CONVERSATION, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]],
     "line 3, field 'messages': ends with an assistant turn, not a user turn"),
    ([CONVERSATION, [{"role": "user", "text": "Hi"}]], "line 3, field 'messages[0]': no key 'content'"),
], ids=["unknown-role", "not-a-list", "no-user-turn-last", "no-content"])
def test_a_malformed_conversation_names_file_line_and_field(runs, tmp_path, capsys, lines, message):
    src = tmp_path / "convs.jsonl"  # a blank line 2: lines are counted in the file
    src.write_text(json.dumps({"messages": lines[0]}) + "\n\n" + json.dumps({"messages": lines[1]}) + "\n")
    assert main([str(runs["imdb"]["export"].path), "--file", str(src), "--messages-column", "messages"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{src}: {message}" in err, err


@pytest.mark.parametrize("argv,message", [
    (["--text", "a", "--chat", "b"], "give one of --text, --chat or --file, not --text and --chat"),
    (["--messages-column", "messages", "--chat", "b"], "--messages-column names a column of --file"),
    (["--text", "a", "--system", "Be brief."], "--system goes with --chat or --messages-column"),
    (["--chat", " "], "--chat: an empty text"),
], ids=["text-and-chat", "column-without-file", "system-without-chat", "empty-chat"])
def test_chat_options_that_do_not_go_together_are_one_line(runs, capsys, argv, message):
    assert main([str(runs["imdb"]["export"].path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err


def test_an_export_whose_outputs_are_not_finite_is_one_line_exit_2(runs, tmp_path, capsys):
    folder = tmp_path / "export"
    shutil.copytree(runs["imdb"]["export"].path, folder)
    weights = load_file(folder / "model.safetensors")
    head = next(k for k in weights if k.startswith("score."))
    weights[head] = weights[head].fill_(float("nan"))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert main([str(folder), "--text", "Great film.", "--text", "Dull."]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: export {folder}: predict: the model's outputs are NaN or infinite for 2 of 2 rows; its "
                   f"weights are corrupt or diverged; export it again from a verified store (finetune inspect "
                   f"verify)"), err
