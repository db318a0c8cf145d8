"""Resume after a crash: `kill -9` at a random step, rerun, same final weights as an uninterrupted run."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_train import PAD, cls_rows, max_diff, tcfg, tiny_classifier, trainable

from stages.train import TrainRun, train_model
from stages.training.checkpoint import checkpoints, latest_checkpoint
from stages.training.runlog import read_metrics

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
log = logging.getLogger("test.resume")
STEPS = 24  # 96 rows / effective batch 8 = 12 steps per epoch, 2 epochs


def settings(**kw):
    base = {"micro_batch_size": 4, "gradient_accumulation_steps": 2, "epochs": 2, "checkpoint_every": 3,
            "keep_checkpoints": 2, "lr_scheduler": "linear", "warmup_steps": 2, "max_grad_norm": 1.0}
    return tcfg(**{**base, **kw})


def train(work: Path, out: Path, **kw) -> tuple[dict, dict]:
    # dropout on, so the resumed run only matches if the RNG state was restored too
    model = tiny_classifier(dropout=0.1)
    m = train_model(model, cls_rows(96, seed=11), cls_rows(16, seed=12), settings(**kw), "seq_cls", PAD, out, work,
                    log)
    return m, trainable(model)


def after_step(monkeypatch, act) -> None:
    """`act(step)` after each finished step, where the loop lets a requested stop take effect."""
    real = TrainRun.stop_here

    def stop_here(self):
        act(self.progress.step)
        real(self)

    monkeypatch.setattr(TrainRun, "stop_here", stop_here)


def crash_at(step: int):
    def act(s: int) -> None:
        if s == step:
            raise KeyboardInterrupt

    return act


def child(work: str, out: str) -> None:
    """Run in a subprocess: train, printing each finished step, slowly enough to be killed mid-run."""
    from test_train_health import slow_steps

    torch.set_num_threads(1)
    slow_steps(TrainRun)
    train(Path(work), Path(out))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    torch.set_num_threads(1)  # the same threads as the child, so the same float sums
    d = tmp_path_factory.mktemp("ref")
    return train(d / "work", d / "out")


@pytest.mark.parametrize("trial", [0, 1, 2])
def test_kill_9_at_a_random_step_then_rerun_resumes_and_matches(trial, reference, tmp_path, caplog):
    ref_metrics, ref_weights = reference
    # a random step that is not a checkpoint step, so the rerun must redo steps the killed run had done
    kill_at = random.Random(1000 + trial).choice([s for s in range(2, STEPS - 2) if s % 3])
    work, out = tmp_path / "work", tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (ROOT, ROOT / "tests", HERE)))}  # pytest's pythonpath
    proc = subprocess.Popen([sys.executable, "-c", f"from test_resume import child; child({str(work)!r}, {str(out)!r})"],
                            cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:
            if line.startswith("STEP"):
                seen.append(int(line.split()[1]))
                if seen[-1] >= kill_at:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"child ended on its own: {seen}"
    last = latest_checkpoint(work / "checkpoints")
    assert last is not None and not (out / "metrics.jsonl").exists()
    ckpt_step = int(last.name.split("-")[1])

    torch.set_num_threads(1)
    with caplog.at_level(logging.INFO, logger="test.resume"):
        m, weights = train(work, out)
    resumed = [r.message for r in caplog.records if "resumed from step" in r.message]
    diff = max_diff(ref_weights, weights)
    print(f"trial {trial}: killed after step {seen[-1]} (target {kill_at}), resumed from step {ckpt_step}, "
          f"max |w - w_uninterrupted| = {diff:.2e}")
    assert len(resumed) == 1 and f"resumed from step {ckpt_step} " in resumed[0]
    assert m["resumed_from_step"] == ckpt_step and 0 < ckpt_step < seen[-1]
    assert diff <= 1e-6
    assert m["validation"] == ref_metrics["validation"] and m["real_tokens"] == ref_metrics["real_tokens"]
    assert m["first_loss"] == ref_metrics["first_loss"]  # the run's first loss, not the resumed part's
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["kind"] == "train"]
    assert steps == list(range(1, STEPS + 1))  # nothing lost or doubled across the kill


def test_crash_and_resume_with_an_8bit_optimizer(tmp_path, caplog, monkeypatch):
    """bitsandbytes optimizer state round-trips through the weights_only checkpoint."""
    kw = {"optimizer": "adamw_8bit", "checkpoint_every": 2, "max_steps": 6}
    _, ref = train(tmp_path / "w0", tmp_path / "o0", **kw)
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        after_step(patch, crash_at(3))
        train(tmp_path / "w1", tmp_path / "o1", **kw)
    with caplog.at_level(logging.INFO, logger="test.resume"):
        _, got = train(tmp_path / "w1", tmp_path / "o1", **kw)
    assert any("resumed from step 2 " in r.message for r in caplog.records)
    assert max_diff(ref, got) <= 1e-6
    state = torch.load(latest_checkpoint(tmp_path / "w1" / "checkpoints") / "state.pt", weights_only=True)
    assert {"optimizer", "scheduler", "scaler", "rng"} <= state.keys()


def test_resume_from_an_older_checkpoint_without_first_loss(tmp_path, caplog, monkeypatch):
    """A checkpoint written before progress.json had first_loss: the run resumes from it, ends with the
    uninterrupted run's weights and reports the first loss it saw itself (step 3's)."""
    kw = {"checkpoint_every": 2, "max_steps": 6}
    m0, ref = train(tmp_path / "w0", tmp_path / "o0", **kw)
    # each step's loss as the run logged it (rounded to 6 places)
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "o0" / "metrics.jsonl") if r["kind"] == "train"}
    assert sorted(losses) == list(range(1, 7)) and abs(losses[3] - losses[1]) > 1e-3
    assert m0["first_loss"] == pytest.approx(losses[1], abs=1e-6)
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        after_step(patch, crash_at(3))
        train(tmp_path / "w1", tmp_path / "o1", **kw)
    progress_file = latest_checkpoint(tmp_path / "w1" / "checkpoints") / "progress.json"
    older = json.loads(progress_file.read_text())
    assert older.pop("first_loss") == m0["first_loss"]
    progress_file.write_text(json.dumps(older))
    with caplog.at_level(logging.INFO, logger="test.resume"):
        m, got = train(tmp_path / "w1", tmp_path / "o1", **kw)
    assert any("resumed from step 2 " in r.message for r in caplog.records)
    assert max_diff(ref, got) <= 1e-6
    assert m["first_loss"] == pytest.approx(losses[3], abs=1e-6)


def test_incomplete_checkpoints_are_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step-000004").mkdir(parents=True)
    (root / "step-000004" / "progress.json").write_text("{}")
    (root / "step-000009").mkdir()  # killed before progress.json: not a checkpoint
    (root / ".tmp-abc").mkdir()
    assert [s for s, _ in checkpoints(root)] == [4]
    assert latest_checkpoint(root).name == "step-000004"


@pytest.mark.parametrize("where", ["after step 5", "mid-step 6"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_checkpoints_the_last_finished_step_and_resume_matches(where, signum, reference, tmp_path,
                                                                            caplog, monkeypatch):
    """Ctrl-C / SIGTERM (a real signal to this process) at a step that is no checkpoint step: a checkpoint
    is written at step 5 (mid-step 6: that step is abandoned at its second micro-batch), the signal then
    takes its course (here a handler raising), and the resumed run ends with the uninterrupted weights."""
    ref_metrics, ref_weights = reference
    work, out = tmp_path / "work", tmp_path / "out"
    torch.set_num_threads(1)
    model = tiny_classifier(dropout=0.1)
    calls = {"forwards": 0}

    def after(step):
        if where == "after step 5" and step == 5:
            os.kill(os.getpid(), signum)

    def forward_hook(module, args):
        calls["forwards"] += 1  # 2 micro-batches a step: the 11th forward is step 6's first
        if where == "mid-step 6" and calls["forwards"] == 11:
            os.kill(os.getpid(), signum)

    class Stopped(Exception):
        pass

    def raise_stopped(sig, frame):
        raise Stopped(sig)

    model.register_forward_pre_hook(forward_hook)
    before = signal.signal(signum, raise_stopped)
    try:
        with monkeypatch.context() as patch, pytest.raises(Stopped), caplog.at_level(logging.INFO, logger="test.resume"):
            after_step(patch, after)
            train_model(model, cls_rows(96, seed=11), cls_rows(16, seed=12), settings(), "seq_cls", PAD, out, work,
                        log)
    finally:
        handler_after = signal.signal(signum, before)
    assert handler_after is raise_stopped  # the handler from before the run is back
    assert calls["forwards"] == (10 if where == "after step 5" else 11)  # step 6's second micro-batch never ran
    assert [s for s, _ in checkpoints(work / "checkpoints")] == [3, 5]
    stop_lines = [r.message for r in caplog.records if "the next run resumes from it" in r.message]
    assert len(stop_lines) == 1 and "at step 5 of 24" in stop_lines[0], stop_lines

    with caplog.at_level(logging.INFO, logger="test.resume"):
        m, weights = train(work, out)
    assert any("resumed from step 5 " in r.message for r in caplog.records)
    assert max_diff(ref_weights, weights) <= 1e-6
    assert m["validation"] == ref_metrics["validation"] and m["real_tokens"] == ref_metrics["real_tokens"]
