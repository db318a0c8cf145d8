"""Multi-process training: the train loop under `accelerate launch` (2 gloo processes on CPU) against one
process on the same data order."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from helpers import needs_shared_data, run
from tiny_train import PAD, cls_rows, max_diff, tcfg, tiny_classifier, trainable

from stages.common.batching import epoch_batches, shard
from stages.common.checkpoint import checkpoints
from stages.common.distributed import LaunchError, launch
from stages.engine.errors import ConfigError
from stages.train import train_model

HERE = Path(__file__).resolve().parent
PATHS = [str(HERE), str(HERE.parent)]  # this module and tests/helpers.py, importable in the launched processes
log = logging.getLogger("test.distributed")
# 25 rows / effective batch 4: 6 full batches and a last batch of one row (one process gets none), 2 epochs
ROWS, SEED = 25, 13
SETTINGS = {"micro_batch_size": 1, "epochs": 2, "optimizer": "adamw_torch", "max_grad_norm": 1.0,
            "lr_scheduler": "linear", "warmup_steps": 2, "checkpoint_every": 5}


def train_tiny(args: dict) -> dict:
    """Runs in each launched process: the tiny classifier, 1 x 2 per process; rank 0 saves its weights.
    With `crash_at`, process 1 raises after that optimizer step."""
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])  # set by the launcher (the process group starts inside train_model)

    def on_step(step: int, loss: float) -> None:
        if rank == 1 and step == args.get("crash_at"):
            raise RuntimeError(f"boom in the worker at step {step}")

    model = tiny_classifier()
    m = train_model(model, cls_rows(ROWS, seed=SEED), cls_rows(8, seed=SEED + 1),
                    tcfg(**SETTINGS, gradient_accumulation_steps=2), "seq_cls", PAD, Path(args["out"]),
                    Path(args["work"]), logging.getLogger("test.distributed"), on_step=on_step)
    if rank == 0:
        save_file(trainable(model), args["weights"])
    return m


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, dict]:
    """1 process x micro-batch 1 x accumulation 4, in this process."""
    d = tmp_path_factory.mktemp("ref")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only contend with the launched processes
    try:
        model = tiny_classifier()
        m = train_model(model, cls_rows(ROWS, seed=SEED), cls_rows(8, seed=SEED + 1),
                        tcfg(**SETTINGS, gradient_accumulation_steps=4), "seq_cls", PAD, d / "out", d / "work", log)
    finally:
        torch.set_num_threads(threads)
    return m, trainable(model)


def test_shards_are_disjoint_and_cover_the_effective_batch():
    lengths = [len(r["input_ids"]) for r in cls_rows(ROWS, seed=SEED)]
    for batch in epoch_batches(lengths, 4, seed=1, epoch=0):
        parts = [shard(batch, lengths, r, 2) for r in range(2)]
        assert sorted(parts[0] + parts[1]) == sorted(batch) and not set(parts[0]) & set(parts[1])


def test_two_processes_by_1x2_match_one_process_by_1x4(tmp_path, reference):
    """Acceptance: 2 processes (gloo) x micro-batch 1 x accumulation 2 = 1 process x micro-batch 1 x accumulation 4."""
    from safetensors.torch import load_file

    ref, ref_weights = reference
    out, work = tmp_path / "o2", tmp_path / "w2"
    m = launch("test_distributed:train_tiny", {"out": str(out), "work": str(work), "weights": str(tmp_path / "w.st")},
               2, tmp_path / "launch", log, pythonpath=PATHS)
    diff = max_diff(ref_weights, load_file(str(tmp_path / "w.st")))
    print(f"2 processes x 1 x 2 vs 1 process x 1 x 4, {m['steps']} steps: max |w2 - w1| = {diff:.2e}")
    assert diff < 1e-5
    assert m["steps"] == ref["steps"] == 14 and m["effective_batch"] == ref["effective_batch"] == 4
    assert m["num_processes"] == 2 and m["gradient_accumulation_steps"] == 2 and ref["num_processes"] == 1
    assert m["real_tokens"] == ref["real_tokens"] and m["padded_tokens"] >= m["real_tokens"]
    assert m["final_loss"] == pytest.approx(ref["final_loss"], abs=1e-5)
    assert [v["val_loss"] for v in m["validation"]] == pytest.approx([v["val_loss"] for v in ref["validation"]], abs=1e-5)
    # rank 0 alone wrote the run log and the checkpoints
    train_lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in train_lines if x["kind"] == "train"] == list(range(1, 15))
    assert [s for s, _ in checkpoints(work / "checkpoints")] == [10, 14]


@needs_shared_data
def test_the_stage_with_two_processes_through_the_store(store_dir):
    """train.num_processes=2 on tiny-imdb: the stage launches itself, rank 0 writes the artifact, the
    manifest reports the effective batch with the processes; a config error inside is the stage's error."""
    from stages.common.model_loading import load_trained

    out = run("tiny-imdb", "train.num_processes=2", "train.max_steps=2", until="train")
    art, m = out["train"].path, out["train"].manifest["metrics"]
    assert (m["num_processes"], m["micro_batch_size"], m["gradient_accumulation_steps"]) == (2, 4, 2)
    assert m["effective_batch"] == 16 and m["steps"] == 2 and m["real_tokens"] > 0
    assert {"model.safetensors", "config.json"} <= {p.name for p in (art / "trained").iterdir()}
    assert (art / "metrics.jsonl").is_file() and (art / "loss.png").is_file()
    load_trained(out["model"].path, out["adapters"].path, art)
    with pytest.raises(ConfigError, match=r"fp16 needs a CUDA GPU.*\(raised in process [01] of 2\)"):
        run("tiny-imdb", "train.num_processes=2", "train.max_steps=2", "train.mixed_precision=fp16", until="train")


def test_a_crashed_process_is_a_clear_stage_error_and_the_rerun_resumes(tmp_path, reference, caplog):
    """Process 1 dies after step 7: one LaunchError naming the exception and the fix; the rerun resumes
    from rank 0's step-5 checkpoint and ends with the uninterrupted weights."""
    from safetensors.torch import load_file

    args = {"out": str(tmp_path / "out"), "work": str(tmp_path / "work"), "weights": str(tmp_path / "w.st")}
    crash = r"process 1 of 2 under accelerate launch failed with RuntimeError: boom in the worker at step 7 .*num_processes=1"
    with pytest.raises(LaunchError, match=crash):
        launch("test_distributed:train_tiny", {**args, "crash_at": 7}, 2, tmp_path / "launch", log, pythonpath=PATHS)
    assert [s for s, _ in checkpoints(tmp_path / "work" / "checkpoints")] == [5]
    # the rerun also passes an accelerate config file (DDP; its num_processes is overridden by ours)
    config = tmp_path / "accelerate.yaml"
    config.write_text("distributed_type: MULTI_GPU\nnum_processes: 8\nnum_machines: 1\ngpu_ids: all\n")
    with caplog.at_level(logging.INFO, logger="test.distributed"):
        m = launch("test_distributed:train_tiny", args, 2, tmp_path / "launch", log, pythonpath=PATHS,
                   config_file=config)
    assert m["resumed_from_step"] == 5 and any("resumed from step 5 " in r.message for r in caplog.records)
    diff = max_diff(reference[1], load_file(args["weights"]))
    print(f"crashed after step 7, resumed from step 5: max |w - w_reference| = {diff:.2e}")
    assert diff < 1e-5
    steps = [json.loads(x)["step"] for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["kind"] == "train"]
    assert steps == list(range(1, 15))  # nothing lost or doubled across the crash


def test_accelerate_config_must_be_ddp(tmp_path):
    from stages.common.distributed import check_accelerate_config
    from stages.engine.errors import MissingInputError

    with pytest.raises(MissingInputError, match="train.accelerate_config: .* not found; write one with `accelerate config"):
        check_accelerate_config(tmp_path / "none.yaml")
    (tmp_path / "fsdp.yaml").write_text("distributed_type: FSDP\nfsdp_config: {fsdp_version: 2}\n")
    with pytest.raises(ConfigError, match="distributed_type FSDP; the train stage runs DDP only"):
        check_accelerate_config(tmp_path / "fsdp.yaml")
    (tmp_path / "cpu.yaml").write_text("distributed_type: MULTI_CPU\nuse_cpu: true\n")
    with pytest.raises(ConfigError, match="use_cpu: true, with which accelerate launch starts one process"):
        check_accelerate_config(tmp_path / "cpu.yaml")
    (tmp_path / "ddp.yaml").write_text("distributed_type: MULTI_GPU\ngpu_ids: 0,1\n")
    assert check_accelerate_config(tmp_path / "ddp.yaml") == tmp_path / "ddp.yaml"
