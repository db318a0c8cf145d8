"""Multi-process training: the train loop under `accelerate launch` (2 gloo processes on CPU; or 2 "machines"
of 1 process each, two launcher invocations meeting at one rendezvous on loopback) against one process on
the same data order."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import ROOT, computed, needs_shared_data, run, spawn, subprocess_env
from tiny_train import PAD, cls_rows, max_diff, tcfg, tiny_classifier, trainable

from stages.engine.errors import ConfigError
from stages.engine.store import Store, publishing_work
from stages.train import TrainRun, train_model
from stages.training.batching import epoch_batches, shard
from stages.training.checkpoint import checkpoints
from stages.training.distributed import LaunchError, free_port, launch

HERE = Path(__file__).resolve().parent
PATHS = [str(HERE), str(HERE.parent)]  # this module and tests/helpers.py, importable in the launched processes
log = logging.getLogger("test.distributed")
# 25 rows / effective batch 4: 6 full batches and a last batch of one row (one process gets none), 2 epochs
ROWS, SEED = 25, 13
SETTINGS = {"micro_batch_size": 1, "epochs": 2, "optimizer": "adamw_torch", "max_grad_norm": 1.0,
            "lr_scheduler": "linear", "warmup_steps": 2, "checkpoint_every": 5}


def train_tiny(args: dict) -> dict:
    """Runs in each launched process: the tiny classifier, 1 x 2 per process; rank 0 saves its weights.
    With `crash_at`, process 1 raises after that optimizer step; `settings` override SETTINGS."""
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])  # set by the launcher (the process group starts inside train_model)
    if rank == 1 and "crash_at" in args:  # this process only: patched after each finished step
        real = TrainRun.stop_here

        def stop_here(self: TrainRun) -> None:
            if self.progress.step == args["crash_at"]:
                raise RuntimeError(f"boom in the worker at step {self.progress.step}")
            real(self)

        TrainRun.stop_here = stop_here  # type: ignore[method-assign]

    model = tiny_classifier()
    m = train_model(model, cls_rows(ROWS, seed=SEED), cls_rows(8, seed=SEED + 1),
                    tcfg(**{**SETTINGS, "gradient_accumulation_steps": 2, **args.get("settings", {})}), "seq_cls",
                    PAD, Path(args["out"]), Path(args["work"]), logging.getLogger("test.distributed"))
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


def published(record: Path, folder: Path) -> None:
    """What a shared store's publish_work is handed in the stage's process: here, the folder's name, appended
    to `record` once the folder is a complete checkpoint (progress.json, written last, is there)."""
    assert (folder / "progress.json").is_file() and (folder / "trainable.safetensors").is_file()
    with open(record, "a") as f:
        f.write(f"{folder.parent.name}/{folder.name}\n")


def handed_over(record: Path) -> list[str]:
    return record.read_text().split() if record.exists() else []


def two_machines(tmp_path: Path, **extra) -> tuple[dict, dict]:
    """Machines 0 and 1, one process each: two `accelerate launch` invocations (machine 1's in a thread),
    each with its own work and launch folders, meeting at one rendezvous on 127.0.0.1. Returns both results."""
    port = free_port()

    def machine(rank: int) -> dict | None:
        d = tmp_path / f"machine{rank}"
        with publishing_work(lambda folder: published(tmp_path / f"published{rank}.txt", folder)):
            return launch("test_distributed:train_tiny", {"out": str(d / "out"), "work": str(d / "work"),
                                                          "weights": str(tmp_path / f"w{rank}.st"), **extra},
                          1, d / "launch", log, pythonpath=PATHS, num_machines=2, machine_rank=rank,
                          main_process_ip="127.0.0.1", port=port)

    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(machine, 1)
        try:
            first = machine(0)
        finally:
            second = other.result()  # on a failure machine 0's error wins; machine 1's is chained to it
    return first, second


def test_two_machines_by_1x2_match_one_process_by_1x4_across_a_crash(tmp_path, reference):
    """Acceptance: 2 machines x 1 process (gloo) x micro-batch 1 x accumulation 2 = 1 process x 1 x 4. Machine
    1's process dies after step 7; on the rerun machine 0's step-5 checkpoint, which machine 1 cannot see,
    reaches it over the process group, both resume from step 5 and end on the reference weights. The first
    process of machine 0 alone wrote the weights, the run log and the checkpoints."""
    from safetensors.torch import load_file

    ref, ref_weights = reference
    with pytest.raises(LaunchError, match=r"under accelerate launch failed .*set train.num_machines=1 and train.num_processes=1"):
        two_machines(tmp_path, crash_at=7)
    assert [s for s, _ in checkpoints(tmp_path / "machine0" / "work" / "checkpoints")] == [5]
    m, other = two_machines(tmp_path)
    diff = max_diff(ref_weights, load_file(str(tmp_path / "w0.st")))
    print(f"2 machines x 1 process x 1 x 2 (crashed after step 7, resumed from step 5) vs 1 process x 1 x 4, "
          f"{m['steps']} steps: max |w2 - w1| = {diff:.2e}")
    assert diff < 1e-5
    assert m["resumed_from_step"] == 5 and other is None and not (tmp_path / "w1.st").exists()
    assert m["steps"] == ref["steps"] == 14 and m["effective_batch"] == ref["effective_batch"] == 4
    assert m["num_processes"] == 2 and m["num_machines"] == 2 and m["gradient_accumulation_steps"] == 2
    assert m["final_loss"] == pytest.approx(ref["final_loss"], abs=1e-5)
    assert [s for s, _ in checkpoints(tmp_path / "machine0" / "work" / "checkpoints")] == [10, 14]
    steps = [json.loads(x)["step"] for x in (tmp_path / "machine0" / "out" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["kind"] == "train"]
    assert steps == list(range(1, 15))
    # machine 1 wrote nothing but the checkpoint it received
    assert not (tmp_path / "machine1" / "out").exists()
    assert [p.name for p in (tmp_path / "machine1" / "work").iterdir()] == ["received"]
    assert [s for s, _ in checkpoints(tmp_path / "machine1" / "work" / "received" / "rank-1")] == [5]
    # each checkpoint was handed to machine 0's stage process to publish, once; machine 1's never saw one
    assert handed_over(tmp_path / "published0.txt") == [f"checkpoints/step-{s:06d}" for s in (5, 10, 14)]
    assert handed_over(tmp_path / "published1.txt") == []


@needs_shared_data
def test_the_stage_with_two_processes_through_the_store(store_dir):
    """train.num_processes=2 on tiny-imdb: the stage launches itself, rank 0 writes the artifact, the
    manifest reports the effective batch with the processes; a config error inside is the stage's error."""
    from stages.models.model_loading import load_trained

    out = run("tiny-imdb", "train.num_processes=2", "train.max_steps=2", until="train")
    art, m = out["train"].path, out["train"].manifest["metrics"]
    assert (m["num_processes"], m["micro_batch_size"], m["gradient_accumulation_steps"]) == (2, 4, 2)
    assert m["effective_batch"] == 16 and m["steps"] == 2 and m["real_tokens"] > 0
    assert {"model.safetensors", "config.json"} <= {p.name for p in (art / "trained").iterdir()}
    assert (art / "metrics.jsonl").is_file() and (art / "loss.png").is_file()
    load_trained(out["model"].path, out["adapters"].path, art)


def test_a_config_error_in_a_launched_process_is_the_stage_error_of_its_class(tmp_path):
    """fp16 on a CPU, past the plan-time check (launched directly): each process refuses it, and the launch
    raises that ConfigError, its message saying where it was raised."""
    if torch.cuda.is_available():
        pytest.skip("fp16 works on this machine's GPU")
    args = {"out": str(tmp_path / "o"), "work": str(tmp_path / "w"), "weights": str(tmp_path / "w.st"),
            "settings": {"mixed_precision": "fp16"}}
    with pytest.raises(ConfigError, match=r"^train.mixed_precision: fp16 needs a CUDA GPU.*\(raised in process [01] of 2\)$"):
        launch("test_distributed:train_tiny", args, 2, tmp_path / "launch", log, pythonpath=PATHS)


@needs_shared_data
def test_the_stage_on_two_machines_each_with_its_own_store(tmp_path, store_dir):
    """The multi-machine walkthrough on loopback: the same pipeline command on "machine 1" (a `python -m
    stages` process with its own store) and on machine 0 (this process), machine_rank apart. Machine 0
    commits the train artifact of the global batch; machine 1 trained with it, committed no train artifact
    and stopped after train."""
    sets = ["train.max_steps=2", "train.num_machines=2", "train.main_process_ip=127.0.0.1",
            f"train.main_process_port={free_port()}"]
    other = spawn(["tiny-imdb", "--until", "evaluate", *[a for s in [*sets, "train.machine_rank=1"] for a in ("--set", s)]],
                  tmp_path / "store1")
    try:
        out = run("tiny-imdb", *sets, until="train")
    finally:
        printed, _ = other.communicate(timeout=600)
    assert other.returncode == 0, printed[-3000:]
    m = out["train"].manifest["metrics"]
    assert (m["num_machines"], m["num_processes"], m["micro_batch_size"], m["gradient_accumulation_steps"]) == (2, 2, 4, 2)
    assert m["effective_batch"] == 16 and m["steps"] == 2
    joined = [line for line in printed.splitlines() if line.strip().startswith("train ")]
    assert len(joined) == 1 and "joined" in joined[0] and out["train"].key[:12] in joined[0], printed[-3000:]
    assert "evaluate " not in printed  # machine 1 stops after train: it has no train artifact
    assert {stage for stage, _, _ in Store(tmp_path / "store1").entries()} == {"data", "tokenize", "model", "adapters"}


def test_a_crashed_process_is_a_clear_stage_error_and_the_rerun_resumes(tmp_path, reference, caplog):
    """Acceptance: 2 processes (gloo) x micro-batch 1 x accumulation 2 = 1 process x micro-batch 1 x
    accumulation 4, across a crash. Process 1 dies after step 7: one LaunchError naming the exception and the
    fix; the rerun resumes from rank 0's step-5 checkpoint and ends with the uninterrupted run's weights, losses,
    token counts and checkpoints."""
    from safetensors.torch import load_file

    args = {"out": str(tmp_path / "out"), "work": str(tmp_path / "work"), "weights": str(tmp_path / "w.st")}
    crash = r"process 1 of 2 under accelerate launch failed with RuntimeError: boom in the worker at step 7 .*num_processes=1"
    record = tmp_path / "published.txt"
    with pytest.raises(LaunchError, match=crash), publishing_work(lambda folder: published(record, folder)):
        launch("test_distributed:train_tiny", {**args, "crash_at": 7}, 2, tmp_path / "launch", log, pythonpath=PATHS)
    assert [s for s, _ in checkpoints(tmp_path / "work" / "checkpoints")] == [5]
    # the rerun also passes an accelerate config file (DDP; its num_processes is overridden by ours)
    config = tmp_path / "accelerate.yaml"
    config.write_text("distributed_type: MULTI_GPU\nnum_processes: 8\nnum_machines: 1\ngpu_ids: all\n")
    with caplog.at_level(logging.INFO, logger="test.distributed"), \
            publishing_work(lambda folder: published(record, folder)):
        m = launch("test_distributed:train_tiny", args, 2, tmp_path / "launch", log, pythonpath=PATHS,
                   config_file=config)
    assert m["resumed_from_step"] == 5 and any("resumed from step 5 " in r.message for r in caplog.records)
    diff = max_diff(reference[1], load_file(args["weights"]))
    print(f"crashed after step 7, resumed from step 5: max |w - w_reference| = {diff:.2e}")
    assert diff < 1e-5
    steps = [json.loads(x)["step"] for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["kind"] == "train"]
    assert steps == list(range(1, 15))  # nothing lost or doubled across the crash
    # and the rest of the run is the uninterrupted 1-process run's: 2 processes x 1 x 2 = 1 process x 1 x 4
    ref = reference[0]
    assert m["steps"] == ref["steps"] == 14 and m["effective_batch"] == ref["effective_batch"] == 4
    assert m["num_processes"] == 2 and m["gradient_accumulation_steps"] == 2 and ref["num_processes"] == 1
    assert m["real_tokens"] == ref["real_tokens"] and m["padded_tokens"] >= m["real_tokens"]
    assert m["final_loss"] == pytest.approx(ref["final_loss"], abs=1e-5)
    assert [v["val_loss"] for v in m["validation"]] == pytest.approx([v["val_loss"] for v in ref["validation"]], abs=1e-5)
    assert [s for s, _ in checkpoints(tmp_path / "work" / "checkpoints")] == [10, 14]  # rank 0 alone wrote them
    # and handed each to the launching process to publish, once (the crashed run's step 5, then 10 and 14)
    assert handed_over(record) == [f"checkpoints/step-{s:06d}" for s in (5, 10, 14)]


def test_accelerate_config_must_be_ddp(tmp_path):
    from stages.engine.errors import MissingInputError
    from stages.training.distributed import check_accelerate_config

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


SHARED = ["data.subset={train: 64, validation: 8, test: 8}", "train.num_processes=2", "train.max_steps=40",
          "train.checkpoint_every=2"]


@needs_shared_data
def test_a_two_process_run_killed_mid_train_resumes_on_another_machine_from_the_s3_store(s3_endpoint, tmp_path,
                                                                                         monkeypatch, caplog):
    """Acceptance (issue 31): tiny-imdb with train.num_processes=2 on an s3:// store (moto), "machine" A (its own
    FINETUNE_CACHE) killed with -9, its whole process tree, once a checkpoint is on the shared store; "machine" B
    (a second FINETUNE_CACHE) reruns it: the upstream stages are store hits, train resumes from the checkpoint
    A's rank 0 published and ends on the weights of an uninterrupted 2-process run (a local store)."""
    import psutil
    from safetensors.torch import load_file

    from stages.engine.remote_store import RemoteStore

    url = f"s3://finetune-test/multi-process-{uuid.uuid4().hex[:8]}"
    shared = RemoteStore(url, cache=tmp_path / "reader")
    sets = [a for s in SHARED for a in ("--set", s)]
    with open(tmp_path / "a.log", "w") as out:
        a = subprocess.Popen([sys.executable, "-m", "stages", "tiny-imdb", "--until", "train", *sets], cwd=ROOT,
                             env=subprocess_env(url, FINETUNE_CACHE=str(tmp_path / "a"), FINETUNE_LEASE_TTL_S="4"),
                             stdout=out, stderr=subprocess.STDOUT)
    deadline, latest = time.monotonic() + 300, []
    try:
        while not latest:  # the first checkpoint on the shared store: then machine A dies, mid-train
            assert a.poll() is None, (tmp_path / "a.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint reached the shared store"
            time.sleep(0.2)
            shared.fs.invalidate_cache()
            latest = shared.fs.glob(shared._r(".work", "train-*", "latest.json"))
    finally:
        victims = []
        with contextlib.suppress(psutil.NoSuchProcess):  # (gone already: the assertion above says why)
            tree = psutil.Process(a.pid)
            victims = [*tree.children(recursive=True), tree]  # the stage, accelerate's launcher, its 2 processes
        for p in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        a.wait()
        psutil.wait_procs(victims, timeout=30)
    printed = (tmp_path / "a.log").read_text()
    assert len(victims) >= 4 and "train: resumed from step" not in printed, printed[-3000:]
    shared.fs.invalidate_cache()
    saved = json.loads(shared.fs.cat_file(latest[0]))["folder"]  # the newest checkpoint A published
    at = int(saved.rsplit("-", 1)[1])
    work = latest[0].rsplit("/", 1)[0]
    assert {p.rsplit("/", 1)[1] for p in shared.fs.ls(f"{work}/checkpoints")} == {saved.split("/")[1]}
    assert json.loads(shared.fs.cat_file(f"{work}/resume.json")) == {"step": at, "of": 40}  # the resume point
    assert 2 <= at < 40 and not list((tmp_path / "a").glob("*/train/*"))  # A died mid-train

    monkeypatch.setenv("FINETUNE_STORE", url)
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "b"))
    monkeypatch.setenv("FINETUNE_LEASE_TTL_S", "4")  # A's lease on the train key expires
    with caplog.at_level(logging.INFO):
        t0 = time.perf_counter()
        out = run("tiny-imdb", *SHARED, until="train")
        resumed_s = time.perf_counter() - t0
    m = out["train"].manifest["metrics"]
    assert computed(out) == {"train"} and m["resumed_from_step"] == at and m["steps"] == 40
    assert any(f"train: resumed from step {at} " in r.getMessage() for r in caplog.records)
    shared.fs.invalidate_cache()
    assert not shared.fs.exists(work)  # the commit dropped the shared work
    assert out["train"].path.is_relative_to(tmp_path / "b")

    monkeypatch.setenv("FINETUNE_STORE", str(tmp_path / "reference"))  # the uninterrupted 2-process run
    ref = run("tiny-imdb", *SHARED, until="train")["train"]
    assert ref.key == out["train"].key and ref.manifest["metrics"]["resumed_from_step"] is None
    diffs = {}
    for f in sorted((ref.path / "trained").glob("*.safetensors")):
        w, w_ref = load_file(str(out["train"].path / "trained" / f.name)), load_file(str(f))
        diffs[f.name] = max((w[k] - w_ref[k]).abs().max().item() for k in w_ref)
    print(f"2 processes killed after checkpoint step {at} of 40 on machine A, resumed on machine B in "
          f"{resumed_s:.1f} s: max |w - w_uninterrupted| = {diffs}")
    assert diffs and max(diffs.values()) <= 1e-6
