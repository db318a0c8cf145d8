"""export.formats: [hf, onnx] (stages/formats/onnx_export.py): the classifier's onnx/model.onnx and model_int8.onnx
are checked in onnxruntime against the exported model before the export is committed; a tampered file fails the
check (exit 2) and nothing is committed; `finetune predict --runtime onnx` gives torch's labels; asking for onnx
without its extra, or for a task it does not cover, is one line at plan time."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from helpers import IMDB, needs_shared_data

from flows.predict import main as predict_main
from stages.__main__ import main as stages_main
from stages.engine.errors import FinetuneError
from stages.engine.runner import execute
from stages.engine.store import Store
from stages.formats import onnx_export
from stages.graph import GRAPH
from stages.pipeline.loading import load_pipeline
from stages.sources.arrow import read_split

pytestmark = needs_shared_data
ONNX = (*IMDB, "export.formats=[hf, onnx]", "export.onnx_int8=true")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("onnx-store"))
    cfg = load_pipeline("tiny-imdb", list(ONNX))
    return {o.stage: o for o in execute(GRAPH.plan(cfg, store), store)}, store, cfg


def test_the_onnx_files_are_checked_in_onnxruntime_and_predict_as_torch(exported, tmp_path, capsys):
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out, _, _ = exported
    folder = out["export"].path
    facts = out["export"].manifest["metrics"]["onnx"]
    fp32, int8 = facts["fp32"], facts["int8"]
    assert fp32["rows"] == 8 + 16 and fp32["labels_equal"] == fp32["rows"]  # IMDB: validation 8 + test 16
    assert fp32["max_abs_logit_diff"] <= onnx_export.FP32_TOLERANCE
    assert int8["rows"] == fp32["rows"] and 0 <= int8["labels_equal"] <= int8["rows"]
    assert int8["accuracy_delta"] == pytest.approx(int8["accuracy"] - int8["accuracy_torch"])
    card = (folder / "README.md").read_text()
    assert "- `onnx/`: model.onnx (fp32" in card and "model_int8.onnx (weights int8" in card

    # the file as a user runs it: the folder's tokenizer, onnxruntime alone; logits as torch's
    test = read_split(out["data"].path, "test").column("text").to_pylist()
    tok = AutoTokenizer.from_pretrained(str(folder))
    batch = tok(test, truncation=True, padding=True, return_tensors="np")
    sess = ort.InferenceSession(str(folder / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(["logits"], {k: batch[k].astype(np.int64) for k in ("input_ids", "attention_mask")})[0]
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        want = model(**tok(test, truncation=True, padding=True, return_tensors="pt")).logits.numpy()
    assert np.abs(got - want).max() <= onnx_export.FP32_TOLERANCE

    # finetune predict --runtime onnx / onnx-int8: the same records as torch's (int8: the labels it agreed on)
    src = tmp_path / "reviews.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in test))
    labels = {}
    for runtime in ("torch", "onnx", "onnx-int8"):
        dst = tmp_path / f"{runtime}.jsonl"
        assert predict_main([str(folder), "--file", str(src), "--runtime", runtime, "--out", str(dst)]) == 0
        labels[runtime] = [json.loads(line)["label"] for line in dst.read_text().splitlines()]
    assert labels["onnx"] == labels["torch"] and len(labels["onnx-int8"]) == len(test)
    capsys.readouterr()


def test_a_tampered_onnx_file_fails_its_check_and_nothing_is_committed(exported, monkeypatch):
    import onnx
    from onnx import numpy_helper

    _, store, cfg = exported
    real = onnx_export.write

    def tampered(model, out):
        path = real(model, out)
        m = onnx.load(str(path))
        big = max((t for t in m.graph.initializer if t.data_type == onnx.TensorProto.FLOAT),
                  key=lambda t: int(np.prod(t.dims)))
        w = numpy_helper.to_array(big)  # noise of its own size (a scale alone a layer norm would undo)
        noise = np.random.default_rng(0).normal(0, float(w.std()), w.shape).astype(w.dtype)
        big.CopyFrom(numpy_helper.from_array(w + noise, big.name))
        onnx.save(m, str(path))
        return path

    monkeypatch.setattr(onnx_export, "write", tampered)
    plan = GRAPH.plan(cfg, store, force=["export"])
    committed = store.artifact_dir("export", plan["export"].key.key) / "manifest.json"
    before = committed.read_text()  # the fixture's export, under the same key
    with pytest.raises(FinetuneError, match="does not behave like the exported model in onnxruntime"):
        execute(plan, store)
    assert committed.read_text() == before  # not replaced: the failed export committed nothing


@pytest.mark.parametrize("sets,message", [
    (("export.formats=[hf, onnx]",), "onnxruntime not installed; pip install '.[onnx]'"),
    (("export.onnx_int8=true",), "export.onnx_int8: quantizes the ONNX export; add onnx to export.formats"),
    (("export.formats=[onnx]",), "list hf, e.g. [hf, onnx]"),
], ids=["missing-extra", "int8-without-onnx", "no-hf"])
def test_export_formats_that_cannot_work_are_one_line_at_plan_time(tmp_path, monkeypatch, capsys, sets, message):
    monkeypatch.setenv("FINETUNE_STORE", str(tmp_path / "store"))
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if not installed
    assert stages_main(["tiny-imdb", *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
    assert not (tmp_path / "store").exists()


def test_onnx_for_a_generating_task_and_runtime_onnx_without_the_file_are_one_line(exported, tmp_path, capsys):
    assert stages_main(["smol-chat", "--set", "export.formats=[hf, onnx]"]) == 2
    err = capsys.readouterr().err.strip()
    assert "method sft is not exported to ONNX" in err and "export.formats: [hf, gguf]" in err
    assert "\n" not in err
    out, _, _ = exported
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in out["export"].path.iterdir():  # the same export without its onnx/ folder
        if f.is_file():
            (plain / f.name).write_bytes(f.read_bytes())
    assert predict_main([str(plain), "--runtime", "onnx", "--text", "fine"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no onnx/model.onnx; export the pipeline with export.formats: [hf, onnx]" in err and "\n" not in err
