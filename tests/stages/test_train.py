"""The train stage's loop on tiny random models (CPU, fp32)."""

from __future__ import annotations

import json
import logging
import typing

import pytest
import torch
from helpers import needs_shared_data, run
from tiny_train import (
    PAD,
    cls_rows,
    max_diff,
    s2s_rows,
    tcfg,
    tiny_classifier,
    tiny_t5,
    trainable,
    window_grads,
)

from stages.methods import method_of
from stages.pipeline.schema import TrainConfig
from stages.train import train_model
from stages.training.checkpoint import checkpoints
from stages.training.optim import OPTIMIZERS, lr_factor

log = logging.getLogger("test.train")




@pytest.mark.parametrize("make_model,rows,task", [
    (tiny_classifier, cls_rows(8, seed=1), "seq_cls"),
    (tiny_t5, s2s_rows(8, seed=2), "seq2seq"),
], ids=["classifier", "seq2seq"])
def test_k_by_1_and_1_by_k_give_the_same_gradients(make_model, rows, task, tmp_path, monkeypatch):
    lengths = sorted(len(r["input_ids"]) for r in rows)
    assert lengths[0] * 3 < lengths[-1]  # really uneven
    big = window_grads(make_model, rows, 8, task, tmp_path, monkeypatch)  # micro-batch 8 x accumulation 1
    small = window_grads(make_model, rows, 1, task, tmp_path, monkeypatch)  # micro-batch 1 x accumulation 8
    mid = window_grads(make_model, rows, 3, task, tmp_path, monkeypatch)  # 3 + 3 + 2: uneven micro-batches
    d1, d2 = max_diff(big, small), max_diff(big, mid)
    print(f"{task}: max |grad(8x1) - grad(1x8)| = {d1:.2e}, vs 3x3 = {d2:.2e}")
    assert max(float(g.abs().max()) for g in big.values()) > 1e-3  # gradients are not trivially zero
    assert d1 < 1e-5 and d2 < 1e-5
    # and they are the gradients of the loss averaged over the window's rows / target tokens
    ref = make_model()
    out = method_of(task).step(ref, method_of(task).collate(rows, PAD))
    (out.loss_sum / out.units).backward()
    assert max_diff(big, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}) < 1e-5


def test_the_loop_gives_the_same_weights_for_k_by_1_and_1_by_k(tmp_path):
    rows = cls_rows(48, seed=3)
    out = {}
    for micro, accum in ((4, 1), (1, 4)):
        model = tiny_classifier()
        train_model(model, rows, None, tcfg(micro_batch_size=micro, gradient_accumulation_steps=accum,
                                            max_steps=6, optimizer="adamw_torch", max_grad_norm=1.0),
                    "seq_cls", PAD, tmp_path / f"out{micro}", tmp_path / f"work{micro}", log)
        out[micro] = trainable(model)
    d = max_diff(out[4], out[1])
    print(f"weights after 6 steps, 4x1 vs 1x4: max abs diff {d:.2e}")
    assert d < 1e-5


def test_loss_falls_and_the_artifact_has_metrics_tensorboard_and_plot(tmp_path, caplog):
    rows, val = cls_rows(128, seed=4), cls_rows(32, seed=5)
    model = tiny_classifier()
    with caplog.at_level(logging.INFO, logger="test.train"):
        m = train_model(model, rows, val, tcfg(micro_batch_size=8, gradient_accumulation_steps=2, epochs=5,
                                               lr=3e-3, lr_scheduler="cosine", warmup_steps=4,
                                               weight_decay=0.01, checkpoint_every=10, keep_checkpoints=2),
                        "seq_cls", PAD, tmp_path / "out", tmp_path / "work", log)
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [x["loss"] for x in lines if x["kind"] == "train"]
    assert m["steps"] == len(train) == 40
    first, last = sum(train[:5]) / 5, sum(train[-5:]) / 5
    print(f"loss {first:.4f} -> {last:.4f}; validation {m['validation']}")
    assert last < 0.7 * first
    assert len(m["validation"]) == 5 and m["validation"][-1]["val_accuracy"] > 0.8
    assert 0 < m["padding_share"] < 0.25 and m["real_tokens"] < m["padded_tokens"] and m["tokens_per_s"] > 0
    assert (tmp_path / "out" / "loss.png").stat().st_size > 1000
    assert list((tmp_path / "out" / "tensorboard").glob("events.out.tfevents.*"))
    assert [s for s, _ in checkpoints(tmp_path / "work" / "checkpoints")] == [30, 40]
    assert any("Epoch: 005 | Batch 0008/0008 | Step 0040/0040 | Loss:" in r.message for r in caplog.records)


def test_seq2seq_loss_falls(tmp_path):
    model = tiny_t5()
    m = train_model(model, s2s_rows(64, seed=6), s2s_rows(16, seed=7),
                    tcfg(micro_batch_size=4, gradient_accumulation_steps=2, epochs=4, lr=1e-2),
                    "seq2seq", PAD, tmp_path / "out", tmp_path / "work", log)
    assert m["final_loss"] < 0.8 * m["first_loss"]
    assert len(m["validation"]) == 4 and all(v["val_loss"] > 0 for v in m["validation"])  # token-mean loss


def test_oom_halves_the_micro_batch_and_keeps_the_effective_batch(tmp_path, caplog):
    """An injected CUDA OOM for micro-batches over 2 rows: 8x1 -> 4x2 -> 2x4, and the result equals a 2x4 run."""
    rows = cls_rows(32, seed=8)
    model = tiny_classifier()
    real_forward = model.forward

    def forward(*a, **kw):
        if kw["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real_forward(*a, **kw)

    model.forward = forward
    with caplog.at_level(logging.WARNING, logger="test.train"):
        m = train_model(model, rows, None, tcfg(micro_batch_size=8, max_steps=4), "seq_cls", PAD,
                        tmp_path / "o1", tmp_path / "w1", log)
    msgs = [r.message for r in caplog.records if "out of memory" in r.message]
    assert len(msgs) == 2 and "micro-batch 8 -> 4, accumulation 1 -> 2" in msgs[0]
    assert "micro-batch 4 -> 2, accumulation 2 -> 4 (effective batch 8 unchanged)" in msgs[1]
    assert m["micro_batch_size"] == 2 and m["gradient_accumulation_steps"] == 4 and m["steps"] == 4
    ref = tiny_classifier()
    train_model(ref, rows, None, tcfg(micro_batch_size=2, gradient_accumulation_steps=4, max_steps=4), "seq_cls",
                PAD, tmp_path / "o2", tmp_path / "w2", log)
    model.forward = real_forward
    assert max_diff(trainable(model), trainable(ref)) < 1e-5


@pytest.mark.parametrize("optimizer", ["adam", "adamw_8bit", "paged_adamw_8bit"])
def test_optimizers_train_and_paged_falls_back_once_on_cpu(tmp_path, caplog, optimizer):
    model = tiny_classifier()
    before = trainable(model)
    with caplog.at_level(logging.WARNING, logger="test.train"):
        train_model(model, cls_rows(16), None, tcfg(micro_batch_size=4, max_steps=3, optimizer=optimizer,
                                                    gradient_checkpointing=True, checkpoint_every=2),
                    "seq_cls", PAD, tmp_path / "o", tmp_path / "w", log)
    assert max_diff(before, trainable(model)) > 1e-4
    fallbacks = [r for r in caplog.records if "paging needs CUDA" in r.message]
    assert len(fallbacks) == (1 if optimizer == "paged_adamw_8bit" else 0)


def test_the_optimizer_table_holds_every_name_the_schema_accepts():
    """train.optimizer is checked when the config loads (the schema's choices); each choice has its constructor."""
    assert set(OPTIMIZERS) == set(typing.get_args(TrainConfig.model_fields["optimizer"].annotation))


def test_lr_schedules():
    assert [lr_factor(s, "constant", 2, 10) for s in (0, 1, 2, 9)] == [0.0, 0.5, 1.0, 1.0]
    assert lr_factor(6, "linear", 2, 10) == pytest.approx(0.5)
    assert lr_factor(6, "cosine", 2, 10) == pytest.approx(0.5)
    assert lr_factor(10, "cosine", 2, 10) == pytest.approx(0.0)


def test_causal_lm_loss_counts_target_tokens_only():
    b = method_of("sft").collate([{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
                                  {"input_ids": [5, 9], "labels": [-100, 9]}], PAD)
    assert b.units == 3


@needs_shared_data
@pytest.mark.parametrize("pipeline", ["tiny-billsum", "tiny-imdb"])
def test_stage_through_the_store_and_load_trained(pipeline, store_dir):
    """The registered stage: LoRA (seq2seq, lm_head in modules_to_save) and full (classifier) artifacts,
    read back by load_trained with the trained weights; a second run is a cache hit."""
    from safetensors.torch import load_file

    from stages.models.model_loading import load_trained

    sets = ("train.max_steps=3", "train.log_every=1")
    out = run(pipeline, *sets, until="train")
    art = out["train"].path
    files = {str(p.relative_to(art)) for p in art.rglob("*") if p.is_file()}
    assert {"metrics.jsonl", "loss.png", "manifest.json"} <= files
    assert any(f.startswith("tensorboard/events.out.tfevents") for f in files)
    m = out["train"].manifest["metrics"]
    assert m["steps"] == 3 and m["real_tokens"] > 0 and m["padded_tokens"] >= m["real_tokens"] and m["tokens_per_s"] > 0
    model = load_trained(out["model"].path, out["adapters"].path, art)
    params = dict(model.named_parameters())
    if pipeline == "tiny-billsum":
        saved = load_file(str(art / "trained" / "adapter_model.safetensors"))
        assert any("lm_head" in k for k in saved) and any("lora_A" in k for k in saved)
        lora = {n: p for n, p in params.items() if "lora_A" in n}
        assert lora and not any(p.requires_grad for p in params.values())
        # the loaded adapter is the trained one, not the adapters stage's initial one
        initial = load_file(str(out["adapters"].path / "adapter" / "adapter_model.safetensors"))
        assert any(not torch.equal(saved[k], initial[k]) for k in saved if k in initial)
    else:
        assert {"model.safetensors", "config.json", "finetune.json"} <= {p.name for p in (art / "trained").iterdir()}
        saved = load_file(str(art / "trained" / "model.safetensors"))
        k = next(k for k in saved if k.endswith("score.weight"))
        assert torch.equal(dict(model.state_dict())[k], saved[k])
    again = run(pipeline, *sets, until="train")
    assert not again["train"].computed


def cpu_with(monkeypatch, **caps: bool) -> None:
    """This process sees a CPU with these flags (/proc/cpuinfo's names), its bf16 units detected from them."""
    from stages.models import precision
    from stages.models.precision import UNITS_ENV

    monkeypatch.delenv(UNITS_ENV, raising=False)  # the suite names none (tests/conftest.py): detect instead
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx512f", "avx2", *(k for k, v in caps.items() if v)})


def test_mixed_precision_auto_follows_the_cpus_bf16_units_and_the_gpu(tmp_path, monkeypatch):
    from stages.engine.errors import ConfigError
    from stages.models.precision import UNITS_ENV
    from stages.training.device import resolve_precision

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    cpu_with(monkeypatch, avx512_bf16=True, amx_bf16=False)
    p = resolve_precision("auto", cpu)
    assert (p.name, p.dtype) == ("bf16", torch.bfloat16) and "avx512_bf16" in p.reason
    cpu_with(monkeypatch, amx_bf16=True, avx512_bf16=True)
    assert "amx_bf16, avx512_bf16" in resolve_precision("auto", cpu).reason
    cpu_with(monkeypatch, avx512_bf16=False, amx_bf16=False)  # AVX512 without bf16 units: emulated, slow
    p = resolve_precision("auto", cpu)
    assert (p.name, p.dtype) == ("no", None) and "no bf16 units" in p.reason
    assert "auto would choose no" in resolve_precision("bf16", cpu).reason  # an explicit setting is kept
    monkeypatch.setenv(UNITS_ENV, "avx512_bf16")  # named instead of detected
    assert resolve_precision("auto", cpu).name == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("auto", gpu).name == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_precision("auto", gpu).name == "fp16"  # + accelerate's grad scaler
    with pytest.raises(ConfigError, match="fp16 needs a CUDA GPU"):
        resolve_precision("fp16", cpu)
    monkeypatch.undo()
    model = tiny_classifier().to(torch.bfloat16)  # half-precision trainable weights: upcast_trainable must act
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    m = train_model(model, cls_rows(8), None, tcfg(micro_batch_size=4, max_steps=2, mixed_precision="bf16"),
                    "seq_cls", PAD, tmp_path / "o", tmp_path / "w", log)
    assert m["precision"] == "bf16" and all(p.dtype == torch.float32 for p in model.parameters())
    assert "auto would choose no" in m["precision_reason"]  # the suite's CPU has no bf16 units (conftest)


@needs_shared_data
def test_the_precision_auto_resolves_to_is_in_the_train_and_evaluate_keys(monkeypatch):
    """A machine with bf16 units and one without never share a train (or evaluate) artifact: `auto` is
    resolved before the keys; an explicit setting equal to the resolved one shares it (the same work)."""
    from helpers import plan

    from stages.pipeline.loading import load_pipeline

    def keys(*sets: str) -> dict[str, object]:
        return {p.stage.name: p.key for p in plan(load_pipeline("tiny-imdb", list(sets)))}

    cpu_with(monkeypatch, avx512_bf16=True)
    with_units = keys()
    cpu_with(monkeypatch, avx512_bf16=False)
    without = keys()
    assert with_units["train"].params["train"]["mixed_precision"] == "bf16"
    assert without["train"].params["train"]["mixed_precision"] == "no"
    assert without["evaluate"].params["train.mixed_precision"] == "no"
    differ = {s for s in with_units if with_units[s].key != without[s].key}
    assert differ == {"train", "evaluate", "export"}  # export: train's key is its upstream
    assert keys("train.mixed_precision=bf16")["train"].key == with_units["train"].key


@needs_shared_data
def test_a_quantized_models_auto_compute_dtype_is_resolved_into_the_model_key(monkeypatch):
    """quantization.compute_dtype auto loads 4/8-bit weights in bf16/fp16 on a GPU and fp32 on a CPU: the
    model key holds the dtype picked, so a GPU's and a CPU's quantized model never share an artifact; an
    unquantized model (which does not use it) keeps `auto` in its key."""
    from helpers import plan

    from stages.models import precision
    from stages.pipeline.loading import load_pipeline

    def model_key(*sets: str):
        return next(p.key for p in plan(load_pipeline("tiny-imdb", list(sets))) if p.stage.name == "model")

    q = ("quantization.mode=4bit",)
    on_cpu = model_key(*q)
    assert on_cpu.params["quantization"]["compute_dtype"] == "float32"
    assert model_key(*q, "quantization.compute_dtype=float32").key == on_cpu.key  # the same work, one key
    monkeypatch.setattr(precision, "device_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    on_gpu = model_key(*q)
    assert on_gpu.params["quantization"]["compute_dtype"] == "bfloat16" and on_gpu.key != on_cpu.key
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert model_key(*q).params["quantization"]["compute_dtype"] == "float16"
    assert model_key().params["quantization"]["compute_dtype"] == "auto"  # unquantized: not used, not resolved
