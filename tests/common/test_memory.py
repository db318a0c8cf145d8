"""The memory estimate from the config alone: t5-3b's article figures to the byte (meta device, no
weights), the training terms, and the stop-before-loading check."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stages.engine.errors import ConfigError
from stages.models import memory, model_loading
from stages.models.heads import HEADS
from stages.pipeline.loading import load_pipeline
from stages.pipeline.schema import AdaptersConfig, ModelConfig, PipelineConfig, QuantizationConfig
from stages.training import pipeline_memory

T5_3B = {"model_type": "t5", "d_model": 1024, "d_ff": 16384, "d_kv": 128, "num_heads": 32, "num_layers": 24,
         "vocab_size": 32128, "feed_forward_proj": "relu", "tie_word_embeddings": True}
T5_MODEL = ModelConfig(name="t5-3b", num_labels=None, from_config=T5_3B)
SEQ2SEQ = HEADS["seq2seq"]
T5_FP16 = T5_MODEL.model_copy(update={"dtype": "float16"})  # the article's 4-bit load: the rest in fp16
FULL = AdaptersConfig(method="full")
ARTICLE_LORA = AdaptersConfig(method="lora", r=32, alpha=16, dropout=0.05, target_modules=["v", "o"],
                              modules_to_save=["lm_head"])


def t5_estimate(q: QuantizationConfig, a: AdaptersConfig = FULL, m: ModelConfig = T5_FP16) -> memory.Estimate:
    config = model_loading.hf_config(m, SEQ2SEQ)
    meta, plan = model_loading.meta_and_plan(m, q, config, SEQ2SEQ)
    return memory.adapters_estimate(memory.weights_estimate(meta, plan), meta, plan, a)


def test_t5_3b_article_figures_from_config_alone():
    base = t5_estimate(QuantizationConfig(), FULL, T5_MODEL)
    assert base.footprint == 11_406_393_344 and base.total_params == 2_851_598_336
    nf4 = t5_estimate(QuantizationConfig(mode="4bit", double_quant=True, compute_dtype="bfloat16"), ARTICLE_LORA)
    # 4-bit attention + wi, fp32 wo (48 x 16.8M), fp16 embeddings and norms: the article's 4,293,910,528
    assert nf4.footprint == 4_293_910_528
    assert nf4.fp32_kept_params == 48 * 1024 * 16384
    assert nf4.trainable_params == 56_492_032
    assert base.footprint / nf4.footprint > 2.65
    # double quant: ~1/64 byte per quantized weight (uint8 absmax per 64) plus the fp32 second level;
    # the quant_state is not in get_memory_footprint
    assert nf4.quant_constants == pytest.approx(nf4.quantized_params / 64, rel=0.03)
    with_wo = t5_estimate(QuantizationConfig(mode="4bit", double_quant=True, compute_dtype="bfloat16",
                                             quantize_fp32_modules=True))
    assert with_wo.fp32_kept_params == 0
    assert with_wo.footprint == 4_293_910_528 - 48 * 1024 * 16384 * (4 - 0.5)
    # loading the rest in bf16, transformers 5 keeps wo unquantized but in bf16 (measured: 2,683,297,792)
    bf16 = t5_estimate(QuantizationConfig(mode="4bit", double_quant=True, compute_dtype="bfloat16"), FULL, T5_MODEL)
    assert bf16.fp32_kept_params == 0 and bf16.quantized_params == nf4.quantized_params
    assert bf16.footprint == 2_683_297_792


def test_training_terms_of_tiny_billsum_match_a_real_model_and_the_shapes():
    """tiny-billsum: T5 d_model 32, d_ff 64, 4 heads x d_kv 8, 2 + 2 layers, vocab 30522 (tied embeddings),
    LoRA r=4 on v, o + lm_head saved, micro-batch 2, 256 input + 64 target tokens, fp32 compute."""
    import peft
    import transformers

    cfg = load_pipeline("tiny-billsum", ["quantization.compute_dtype=float32"])
    est = pipeline_memory.estimate_pipeline(cfg)
    # measured on the real model: footprint, then what PEFT adds and makes trainable
    shapes = {k: v for k, v in cfg.model.from_config.items() if k != "model_type"}
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**shapes))
    base = model.get_memory_footprint()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v", "o"],
                                                      modules_to_save=["lm_head"], task_type="SEQ_2_SEQ_LM"))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert est.weights == base == 4 * 1_018_304  # embeddings 976,704 + encoder 16,672 + decoder 24,928, fp32
    assert est.adapters == lora.get_memory_footprint() - base == 4 * trainable
    # by hand: 12 attention blocks (2 encoder self, 2 decoder self, 2 decoder cross) x v, o, each LoRA
    # r x (32 + 32) = 256; the lm_head copy 32 x 30522
    assert est.trainable_params == trainable == 12 * 256 + 32 * 30522 == 979_776
    assert est.gradients == 4 * 979_776  # fp32
    assert est.optimizer == 8 * 979_776  # AdamW: two fp32 states
    # activations (activation_bytes): s = 256 + 64 tokens; per layer 2 x s x (16 x 32 + 2 x 4 x s) x 4 B,
    # 4 layers kept; fp32 logits and their gradient 2 x 4 B x 2 x 64 x 30522
    per_layer, logits = 2 * 320 * (16 * 32 + 2 * 4 * 320) * 4, 2 * 4 * 2 * 64 * 30522
    assert est.activations == 4 * per_layer + logits == 62_711_808
    assert est.total == 4_073_216 + 3_919_104 + 3_919_104 + 7_838_208 + 62_711_808

    def terms(*sets: str) -> memory.Estimate:
        return pipeline_memory.estimate_pipeline(load_pipeline("tiny-billsum", ["quantization.compute_dtype=float32", *sets]))

    assert terms("train.optimizer=paged_adamw_8bit").optimizer == 2 * 979_776  # 8-bit states: 2 bytes
    assert terms("train.micro_batch_size=8").activations == 4 * (4 * per_layer + logits)
    # checkpointing: every layer's input (2 x s x 32 x 4 B) plus one layer's worth
    assert terms("train.gradient_checkpointing=true").activations == 4 * 2 * 320 * 32 * 4 + per_layer + logits
    # a deep model without the logits term, bf16: 24 layers, 4 x 512 tokens
    deep = SimpleNamespace(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, vocab_size=0)
    layer = 4 * 512 * (16 * 1024 + 2 * 16 * 512) * 2
    assert memory.activation_bytes(deep, 4, 512, None, 2, checkpointing=False) == 24 * layer == 3_221_225_472
    assert memory.activation_bytes(deep, 4, 512, None, 2, checkpointing=True) == 24 * 4 * 512 * 1024 * 2 + layer


def test_check_fits_names_the_knobs():
    memory.check_fits(10, "x", free=100, device="dev")
    with pytest.raises(ConfigError) as e:
        memory.check_fits(3_000_000_000, "pipeline p", free=1_070_000_000, device="GPU test")
    msg = str(e.value)
    assert "estimated 3.00 GB but GPU test has 1.07 GB free" in msg
    for knob in ("quantization.mode=4bit", "train.micro_batch_size", "gradient_accumulation_steps",
                 "train.gradient_checkpointing=true"):
        assert knob in msg


def test_cli_prints_estimate(capsys):
    from flows.inspect import main

    assert main(["memory", "tiny-billsum", "--set", "quantization.mode=4bit"]) == 0
    out = capsys.readouterr().out
    assert "weights (get_memory_footprint)" in out and "optimizer states" in out and "free on" in out


def test_estimate_needs_no_weights(monkeypatch):
    # from the config alone: loading any weights would fail here
    import transformers

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("weights loaded")))
    cfg = PipelineConfig.model_validate({"name": "t", "model": T5_MODEL.model_dump(),
                                         "quantization": {"mode": "4bit"}})
    assert pipeline_memory.estimate_pipeline(cfg).weights > 0
