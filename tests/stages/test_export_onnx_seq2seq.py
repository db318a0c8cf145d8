"""export.formats: [hf, onnx] for seq2seq (stages/formats/onnx_export.py): a tiny T5's onnx/encoder.onnx and
decoder.onnx generate greedily in onnxruntime the token ids torch generates (checked before commit; int8
reported), each row stopping at its end token; `finetune predict --runtime onnx` prints torch's texts; a tampered
decoder.onnx fails the check with nothing committed; beams under --runtime onnx are one line."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from helpers import BILLSUM, needs_shared_data

from flows.predict import main as predict_main
from stages.engine.errors import FinetuneError
from stages.engine.runner import execute
from stages.engine.store import Store
from stages.formats import onnx_export
from stages.graph import GRAPH
from stages.pipeline.loading import load_pipeline
from stages.sources.arrow import read_split

pytestmark = needs_shared_data
ONNX = (*BILLSUM, "export.formats=[hf, onnx]", "export.onnx_int8=true")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("onnx-s2s-store"))
    cfg = load_pipeline("tiny-billsum", list(ONNX))
    return {o.stage: o for o in execute(GRAPH.plan(cfg, store), store)}, store, cfg


def test_the_seq2seq_onnx_files_generate_as_torch_and_predict_prints_its_texts(exported, tmp_path, capsys):
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig

    from stages.formats.onnx_export import runtime_model

    out, _, cfg = exported
    folder = out["export"].path
    facts = out["export"].manifest["metrics"]["onnx"]
    fp32, int8 = facts["fp32"], facts["int8"]
    assert fp32["rows"] == 20 and fp32["rows_identical"] == 20  # billsum test split: 20 bills
    assert fp32["tokens_equal_at_position"] == fp32["tokens_generated"] > 0
    assert int8["rows"] == 20 and 0 <= int8["rows_identical"] <= 20
    assert sorted(p.name for p in (folder / "onnx").iterdir()) == [
        "decoder.onnx", "decoder_int8.onnx", "encoder.onnx", "encoder_int8.onnx"]
    card = (folder / "README.md").read_text()
    assert "- `onnx/`: encoder.onnx (input_ids" in card and "greedy generations identical to fp32 torch's" in card

    # rows stopping at different steps: an end token the tiny random model does emit, mid-generation
    texts = read_split(out["data"].path, "test").column("text").to_pylist()[:12]
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSeq2SeqLM.from_pretrained(str(folder)).eval()
    gen = GenerationConfig.from_pretrained(str(folder))
    prompts = [tok(cfg.tokenize.prefix + t, truncation=True)["input_ids"] for t in texts]
    plain = onnx_export.generated_ids(model, prompts, tok, gen)
    eos = Counter(t for row in plain for t in row[1:-1]).most_common(1)[0][0]
    gen.update(eos_token_id=eos)
    with torch.no_grad():
        want = onnx_export.generated_ids(model, prompts, tok, gen)
    got = onnx_export.generated_ids(runtime_model(folder, "onnx"), prompts, tok, gen)
    assert got == want
    assert len({len(r) for r in want}) > 1 and any(r[-1] == eos for r in want)  # stopped at different steps

    # finetune predict --runtime onnx / onnx-int8: torch's texts (int8: as many records)
    src = tmp_path / "bills.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    records = {}
    for runtime in ("torch", "onnx", "onnx-int8"):
        dst = tmp_path / f"{runtime}.jsonl"
        assert predict_main([str(folder), "--file", str(src), "--runtime", runtime, "--out", str(dst),
                             "--precision", "no"]) == 0
        records[runtime] = [json.loads(line) for line in dst.read_text().splitlines()]
    assert records["onnx"] == records["torch"] and len(records["onnx-int8"]) == len(texts)
    assert all(r["generated_tokens"] > 0 for r in records["onnx"])

    # beam search is not decoded by the ONNX loop: one line
    capsys.readouterr()
    assert predict_main([str(folder), "--runtime", "onnx", "--num-beams", "2", "--text", texts[0]]) == 2
    err = capsys.readouterr().err.strip()
    assert "num_beams 2: the ONNX seq2seq export decodes greedily" in err and "\n" not in err


def test_a_tampered_decoder_onnx_fails_its_check_and_nothing_is_committed(exported, monkeypatch):
    import onnx
    from onnx import numpy_helper

    _, store, cfg = exported
    real = onnx_export.write_seq2seq

    def tampered(model, out):
        encoder, decoder = real(model, out)
        m = onnx.load(str(decoder))
        big = max((t for t in m.graph.initializer if t.data_type == onnx.TensorProto.FLOAT),
                  key=lambda t: int(np.prod(t.dims)))
        w = numpy_helper.to_array(big)
        noise = np.random.default_rng(0).normal(0, float(w.std()), w.shape).astype(w.dtype)
        big.CopyFrom(numpy_helper.from_array(w + noise, big.name))
        onnx.save(m, str(decoder))
        return encoder, decoder

    monkeypatch.setattr(onnx_export, "write_seq2seq", tampered)
    plan = GRAPH.plan(cfg, store, force=["export"])
    committed = store.artifact_dir("export", plan["export"].key.key) / "manifest.json"
    before = committed.read_text()
    with pytest.raises(FinetuneError, match=r"decoder.onnx do not behave like the exported model in onnxruntime"):
        execute(plan, store)
    assert committed.read_text() == before
