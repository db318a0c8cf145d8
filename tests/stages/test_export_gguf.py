"""export.formats: [hf, gguf] (stages/formats/gguf_export.py): a causal LM's merged weights converted by llama.cpp's
own converter to gguf/model-f16.gguf and model-q8_0.gguf, each checked in llama.cpp (llama-cpp-python) against the
exported model's greedy generations before the export is committed; a tampered file fails the check (exit 2) and
nothing is committed; `finetune predict --runtime gguf` gives torch's texts; what cannot work is one line at plan
time (a classifier, the adapter alone, the extra missing, the renamed export.format)."""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest
from helpers import FAULTY_LLAMA_CPP
from test_chat_export import SMOLLM2, TINY_LLAMA, run, write_pipeline

from flows.predict import main as predict_main
from stages.__main__ import main as stages_main
from stages.engine.errors import FinetuneError
from stages.engine.runner import execute
from stages.engine.store import Store
from stages.formats import check_formats, gguf_export
from stages.graph import GRAPH
from stages.pipeline.loading import load_pipeline

GGUF = {"formats": ["hf", "gguf"], "gguf_check_tokens": 8}


@pytest.fixture
def faulty_llama(tmp_path, monkeypatch):
    """Put the faulty llama_cpp first on the path of every process started from here on; returns a setter
    (file name, signal name)."""
    (tmp_path / "faulty" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "faulty" / "llama_cpp" / "__init__.py").write_text(FAULTY_LLAMA_CPP)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "faulty"),
                                                                   os.environ.get("PYTHONPATH")])))

    def crash_on(name: str, sig: str = "SIGILL") -> None:
        monkeypatch.setenv("CRASH_ON", name)
        monkeypatch.setenv("CRASH_SIGNAL", sig)

    return crash_on


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    """A prompt/completion causal LM (a tiny random llama, SmolLM2's tokenizer, LoRA) exported with gguf."""
    tmp = tmp_path_factory.mktemp("gguf-export")
    rows = [{"text": f"Question {i}: " + "why " * (i % 7) + "?", "target": f"Answer {i % 5}."} for i in range(24)]
    f = write_pipeline(tmp, "ggufcausal", rows, data={"target_column": "target"}, tokenize={"tokenizer": SMOLLM2},
                       model={"name": "tiny-llama", "from_config": TINY_LLAMA}, evaluate={"max_new_tokens": 6},
                       export=GGUF)
    return run(f, "ggufcausal", tmp / "store"), f, tmp / "store"


def test_the_gguf_files_are_checked_in_llama_cpp_and_predict_as_torch(causal, tmp_path, caplog):
    out, _, _ = causal
    folder = out["export"].path
    m = out["export"].manifest["metrics"]
    assert m["layout"] == "merged"  # auto: llama.cpp's converter reads merged weights
    f16, q8 = m["gguf"]["types"]["f16"], m["gguf"]["types"]["q8_0"]
    n = min(10, gguf_export.CHECK_PROMPTS)  # of the 10 test rows
    assert f16["prompts"] == n and f16["identical"] == n and f16["tokenizer_equal"] == n
    assert f16["reference_tokens"] > 10 and f16["max_new_tokens"] == 8
    assert q8["prompts"] == n and 0 <= q8["identical"] <= n
    assert (folder / "gguf" / "model-f16.gguf").stat().st_size > (folder / "gguf" / "model-q8_0.gguf").stat().st_size
    card = (folder / "README.md").read_text()
    assert "- `gguf/`: llama.cpp's converter's files" in card and "`model-f16.gguf` (f16" in card

    # the f16 file as a user runs it: llama.cpp alone, the prompt's text tokenized by the GGUF's own tokenizer
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(folder / "gguf" / "model-f16.gguf"), n_ctx=256, verbose=False)
    try:
        assert llm.tokenize(b"Question 3: why why why ?", add_bos=False) == \
            __import__("transformers").AutoTokenizer.from_pretrained(str(folder))(
                "Question 3: why why why ?", add_special_tokens=False)["input_ids"]
    finally:
        llm.close()

    # finetune predict --runtime gguf / gguf-q8_0: the same records as torch's (f16: the same texts)
    src = tmp_path / "asked.jsonl"
    src.write_text("".join(json.dumps({"text": f"Question {i}: " + "why " * i + "?"}) + "\n" for i in range(6)))
    got = {}
    caplog.set_level("INFO", logger="finetune.predict")
    for runtime in ("torch", "gguf", "gguf-q8_0"):
        dst = tmp_path / f"{runtime}.jsonl"
        assert predict_main([str(folder), "--file", str(src), "--runtime", runtime, "--out", str(dst),
                             "--batch-size", "4"]) == 0
        got[runtime] = [json.loads(line) for line in dst.read_text().splitlines()]
    assert got["gguf"] == got["torch"] and len(got["gguf-q8_0"]) == 6
    assert "predict: runtime llama.cpp on the CPU, llama.cpp runs model-f16.gguf in its own precision" in caplog.text


def test_a_tampered_gguf_file_fails_its_check_and_nothing_is_committed(causal, monkeypatch):
    _, f, store_dir = causal
    real = gguf_export.convert

    def tampered(src, dst, kind):
        path = real(src, dst, kind)
        if kind == "f16":  # noise over the tensor data at the end of the file (the output weights)
            data = bytearray(path.read_bytes())
            tail = np.frombuffer(bytes(data[-65536:]), dtype=np.float16).copy()
            tail += np.random.default_rng(0).normal(0, 1.0, tail.shape).astype(np.float16)
            data[-65536:] = tail.tobytes()
            path.write_bytes(bytes(data))
        return path

    monkeypatch.setattr(gguf_export, "convert", tampered)
    store = Store(store_dir)
    plan = GRAPH.plan(load_pipeline("ggufcausal", [], path=f), store, force=["export"])
    committed = store.artifact_dir("export", plan["export"].key.key) / "manifest.json"
    before = committed.read_text()
    with pytest.raises(FinetuneError, match="model-f16.gguf does not behave like the exported model in llama.cpp"):
        execute(plan, store)
    assert committed.read_text() == before  # not replaced: the failed export committed nothing


@pytest.mark.parametrize("sets,message", [
    (("export.formats=[hf, gguf]", "method=sft"), "llama-cpp-python not installed; pip install '.[gguf]'"),
    (("export.formats=[hf, gguf]",), "method classify is not exported to GGUF"),
    (("export.format=merged",), "export.format was renamed export.layout"),
], ids=["missing-extra", "classifier", "renamed"])
def test_gguf_that_cannot_work_is_one_line_at_plan_time(tmp_path, monkeypatch, capsys, sets, message):
    monkeypatch.setenv("FINETUNE_STORE", str(tmp_path / "store"))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
    assert stages_main(["tiny-imdb", *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
    assert not (tmp_path / "store").exists()


def test_the_adapter_alone_cannot_be_converted(tmp_path, capsys):
    from stages.engine.errors import ConfigError

    cfg = load_pipeline("tiny-billsum", ["method=sft", "export.formats=[hf, gguf]",
                                         "export.layout=adapter"])
    with pytest.raises(ConfigError, match="^export.formats gguf: written from merged weights.*set export.merge=true"):
        check_formats(cfg)


@pytest.mark.parametrize("sig,how", [("SIGILL", "SIGILL, illegal instruction"),
                                     ("SIGSEGV", "SIGSEGV, segmentation fault")])
def test_a_crash_of_llama_cpp_ends_its_own_process_not_the_caller(faulty_llama, tmp_path, sig, how):
    faulty_llama("model-q8_0.gguf", sig)
    with pytest.raises(gguf_export.RuntimeCrash) as e:
        gguf_export.LlamaProcess(tmp_path / "model-q8_0.gguf", 64)
    assert e.value.how == how


def test_a_type_that_crashes_llama_cpp_fails_the_export_in_one_line_and_commits_nothing(causal, faulty_llama,
                                                                                        tmp_path, monkeypatch, capsys):
    out, f, store_dir = causal
    store = tmp_path / "store"
    shutil.copytree(store_dir, store, ignore=shutil.ignore_patterns("export"))  # every stage before export
    monkeypatch.setenv("FINETUNE_STORE", str(store))
    faulty_llama("model-q8_0.gguf", "SIGILL")
    assert stages_main(["ggufcausal", "--config", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert ("export.formats gguf: llama.cpp failed running model-q8_0.gguf on this CPU (SIGILL, illegal "
            "instruction); nothing was committed. Drop q8_0 from export.gguf_types") in err, err
    assert not list(store.glob("export/*")) and not list(store.glob(".tmp/*"))

    # predict --runtime gguf-q8_0 on the export committed before: one line, exit 2; the f16 file still answers
    src = tmp_path / "asked.jsonl"
    src.write_text(json.dumps({"text": "Question 1: why ?"}) + "\n")
    folder = str(out["export"].path)
    assert predict_main([folder, "--file", str(src), "--runtime", "gguf-q8_0", "--out", str(tmp_path / "q.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "give --runtime torch" in err, err
    assert "--runtime gguf-q8_0: llama.cpp failed running model-q8_0.gguf on this CPU (SIGILL" in err, err
    assert predict_main([folder, "--file", str(src), "--runtime", "gguf", "--out", str(tmp_path / "f.jsonl")]) == 0


def test_the_flow_run_of_a_type_that_crashes_llama_cpp_ends_failed(causal, faulty_llama, prefect_server, tmp_path,
                                                                   monkeypatch):
    from flows.orchestration.finetune_flow import finetune
    from stages.engine.runs import read_runs

    _, f, store_dir = causal
    store = tmp_path / "store"
    shutil.copytree(store_dir, store, ignore=shutil.ignore_patterns("export", "runs"))
    monkeypatch.setenv("FINETUNE_STORE", str(store))
    faulty_llama("model-q8_0.gguf", "SIGILL")
    state = finetune("ggufcausal", config=str(f), return_state=True)
    assert state.is_failed() and "llama.cpp failed running model-q8_0.gguf on this CPU (SIGILL" in state.message
    (run,) = read_runs(store)  # what `finetune inspect runs` lists
    assert run["status"] == "failed" and "SIGILL" in run["error"]
    assert run["stages"][-1] == {"stage": "export", "status": "failed"}
    assert not list(store.glob("export/*"))
