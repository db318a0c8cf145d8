"""Training health: divergence stops the stage (nothing committed, work folder kept), validation during
training, the best weights kept, early stopping, and all of it across a kill -9 and a rerun."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import needs_shared_data, run
from safetensors.torch import load_file
from tiny_train import PAD, cls_rows, max_diff, tcfg, tiny_classifier, trainable

import stages.train as train_stage
from stages.engine.errors import DivergenceError, FinetuneError
from stages.methods.classify import Classify
from stages.train import train_model
from stages.training.checkpoint import TrainingProgress, checkpoints, latest_checkpoint
from stages.training.health import Watchdog
from stages.training.interrupt import DeferredStop
from stages.training.runlog import read_metrics

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
log = logging.getLogger("test.health")
# plateaus: validation accuracy peaks at step 12 (0.9375), then 0.9375, 0.906, 0.906 -> stops at step 18
EARLY = {"micro_batch_size": 8, "max_steps": 200, "lr": 3e-3, "eval_every": 2, "checkpoint_every": 3,
         "select_best": {"metric": "val_accuracy"}, "early_stopping": {"patience": 3}}


def train_early(work: Path, out: Path, **kw) -> tuple[dict, dict]:
    model = tiny_classifier()
    m = train_model(model, cls_rows(64, seed=1), cls_rows(32, seed=2), tcfg(**{**EARLY, **kw}), "seq_cls", PAD,
                    out, work, log)
    return m, trainable(model)


def train_metrics(work: Path) -> list[dict]:
    """What the run logged so far, one record per finished step or validation (work_dir/logs/metrics.jsonl)."""
    return read_metrics(work / "logs" / "metrics.jsonl")


@needs_shared_data
def test_an_injected_nan_stops_the_stage_with_its_step_and_commits_nothing(store_dir, monkeypatch):
    nan_at = 5  # optimizer step whose loss (and so its gradients) turn NaN
    seen = {"step": 0}
    real_start, real_step = DeferredStop.step_starts, Classify.step

    def step_starts(self):  # once per optimizer step in one process
        seen["step"] += 1
        return real_start(self)

    def step(*a, **kw):
        out = real_step(*a, **kw)
        if seen["step"] == nan_at:
            out.loss_sum = out.loss_sum * float("nan")
        return out

    monkeypatch.setattr(DeferredStop, "step_starts", step_starts)
    monkeypatch.setattr(Classify, "step", step)
    sets = ("data.subset={train: 48, validation: 8, test: 8}", "train.max_steps=8", "train.checkpoint_every=2")
    with pytest.raises(DivergenceError) as err:
        run("tiny-imdb", *sets, until="train")
    msg = str(err.value)
    print(msg)
    assert isinstance(err.value, FinetuneError) and err.value.exit_code == 2 and "\n" not in msg
    assert f"diverged at step {nan_at}: the loss is nan" in msg and "lower train.lr" in msg
    work = [d for d in (store_dir / ".work").iterdir() if d.name.startswith("train-")]
    assert len(work) == 1  # the work folder is kept for inspection ...
    assert [s for s, _ in checkpoints(work[0] / "checkpoints")] == [2, 4]  # ... no checkpoint after the NaN
    assert f"the last good checkpoint is {work[0] / 'checkpoints' / 'step-000004'}" in msg
    assert not (store_dir / "train").exists() or not any((store_dir / "train").iterdir())  # nothing committed
    assert (store_dir / "adapters").is_dir()  # while the stages before it were


def test_an_exploding_loss_from_a_huge_learning_rate_is_caught(tmp_path):
    with pytest.raises(DivergenceError, match=r"diverged at step \d+: the loss averaged") as err:
        train_model(tiny_classifier(), cls_rows(128, seed=1), None,
                    tcfg(micro_batch_size=4, gradient_accumulation_steps=4, max_steps=40, lr=0.9), "seq_cls", PAD,
                    tmp_path / "o", tmp_path / "w", log)
    losses = [r["loss"] for r in train_metrics(tmp_path / "w")]  # the steps that reached the weights
    print(err.value, losses)
    assert len(losses) < 10 and f"diverged at step {len(losses) + 1}:" in str(err.value)  # caught at once, before
    assert "no checkpoint was written before it" in str(err.value)  # the step reaches the weights
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_one_hard_row_is_not_divergence_but_a_sustained_rise_is(tmp_path):
    """Effective batch 1, late in training: most rows cost ~0.01, one in 20 is confidently wrong (8.0,
    800x the median). That is noise; the loss settling at 30x its level is not."""
    watch = Watchdog(10.0, 25, False, tmp_path, effective_batch=1)
    progress, rng = TrainingProgress(first_loss=0.69), random.Random(0)
    for step in range(1000):
        progress.step = step
        watch.check(progress, 8.0 if rng.random() < 0.05 else 0.01, 1.0)
    level = sum(progress.recent_losses) / len(progress.recent_losses)
    with pytest.raises(DivergenceError) as err:
        for step in range(1000, 1300):
            progress.step = step
            watch.check(progress, 30 * level, 1.0)
    print(err.value)
    assert "diverged at step" in str(err.value)


def test_fp16_scaler_skips_are_counted_and_only_a_long_run_of_them_is_divergence(tmp_path):
    watch = Watchdog(10.0, 3, True, tmp_path, effective_batch=8)
    progress = TrainingProgress(first_loss=0.7)
    for skipped in (True, True, True, False, True, True, True):  # a non-finite norm is the scaler's to skip
        watch.check(progress, 0.7, float("inf"))
        watch.count_skip(progress, skipped)
        progress.step += 1
    assert progress.skipped_steps == 6 and progress.skipped_in_a_row == 3
    with pytest.raises(DivergenceError, match="skipped 4 steps in a row"):
        watch.count_skip(progress, True)
    with pytest.raises(DivergenceError, match="the gradient norm is inf"):  # without a scaler it is divergence
        Watchdog(10.0, 3, False, tmp_path, effective_batch=8).check(progress, 0.7, float("inf"))


def test_early_stopping_keeps_the_best_step_weights(tmp_path):
    # a checkpoint after every step, all kept: each step's weights as the run wrote them
    m, weights = train_early(tmp_path / "work", tmp_path / "out", checkpoint_every=1, keep_checkpoints=1000)
    snapshots = {s: load_file(str(p / "trainable.safetensors")) for s, p in checkpoints(tmp_path / "work" / "checkpoints")}
    assert sorted(snapshots) == list(range(1, m["steps"] + 1))
    vals = [(v["step"], v["val_accuracy"]) for v in m["validation"]]
    print(m["stopped"], m["best"], vals)
    best = m["best"]
    assert m["steps"] < 200 and m["stopped"].startswith(f"early stopping at step {m['steps']}")
    assert [s for s, _ in vals] == list(range(2, m["steps"] + 1, 2))  # every eval_every steps
    assert best["value"] == max(a for _, a in vals) and best["step"] == min(s for s, a in vals if a == best["value"])
    assert all(a <= best["value"] for s, a in vals if s > best["step"])  # patience ran out on no improvement
    assert len([s for s, _ in vals if s > best["step"]]) == 3  # patience 3
    assert max_diff(weights, snapshots[best["step"]]) == 0  # the model holds the best step's weights
    last = load_file(str(tmp_path / "out" / "last" / "trainable.safetensors"))
    assert max_diff(last, snapshots[m["steps"]]) == 0 and max_diff(last, snapshots[best["step"]]) > 0
    assert (tmp_path / "out" / "loss.png").stat().st_size > 1000


def child(work: str, out: str) -> None:
    """Run in a subprocess: train, printing each finished step, slowly enough to be killed mid-run."""
    torch.set_num_threads(1)
    slow_steps(train_stage.TrainRun)
    train_early(Path(work), Path(out))


def slow_steps(run_class) -> None:
    """After each finished step (its checkpoint written; where a requested stop takes effect): "STEP n" on
    stdout and a pause, for a parent process that kills this one at a chosen step."""
    real = run_class.stop_here

    def stop_here(self):
        print(f"STEP {self.progress.step}", flush=True)
        time.sleep(0.15)
        real(self)

    run_class.stop_here = stop_here


def test_kill_9_after_the_best_step_then_rerun_keeps_the_same_best_and_stops_at_the_same_step(tmp_path, caplog):
    torch.set_num_threads(1)  # the same threads as the child, so the same float sums
    ref_metrics, ref_weights = train_early(tmp_path / "ref-work", tmp_path / "ref-out")
    best, end = ref_metrics["best"]["step"], ref_metrics["steps"]
    # the last checkpoint before the kill comes after the best step and after an evaluation without
    # improvement: the rerun needs both the best weights and the patience count from it
    kill_at = next(s for s in range(best + 3, end) if s % 3 and (s // 3) * 3 > best + 2)
    work, out = tmp_path / "work", tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (ROOT, HERE, HERE.parent)))}
    proc = subprocess.Popen([sys.executable, "-c", f"from test_train_health import child; child({str(work)!r}, "
                             f"{str(out)!r})"], cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
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
    ckpt = latest_checkpoint(work / "checkpoints")
    resumed_at = int(ckpt.name.split("-")[1])
    assert best < resumed_at < kill_at < end and (ckpt / "best.safetensors").is_file()
    with caplog.at_level(logging.INFO, logger="test.health"):
        m, weights = train_early(work, out)
    print(f"best step {best}, killed after step {seen[-1]}, resumed from {resumed_at}, stopped at {m['steps']}")
    assert any(f"resumed from step {resumed_at} " in r.message for r in caplog.records)
    assert m["best"] == ref_metrics["best"] and m["stopped"] == ref_metrics["stopped"] and m["steps"] == end
    assert max_diff(weights, ref_weights) == 0


@needs_shared_data
def test_select_best_through_the_store_commits_the_best_weights_and_the_summary_shows_them(store_dir):
    from flows.reports.run_summary import render, stage_rows
    from stages.engine.remote_store import open_store
    from stages.graph import GRAPH
    from stages.pipeline.loading import load_pipeline

    sets = ["data.subset={train: 48, validation: 16, test: 8}", "train.max_steps=8", "train.lr=1e-2",
            "train.eval_every=2", "train.select_best={metric: val_loss}"]
    art = run("tiny-imdb", *sets, until="train")["train"]
    m = art.manifest["metrics"]
    vals = {v["step"]: v["val_loss"] for v in m["validation"]}
    print(m["best"], vals)
    assert sorted(vals) == [2, 4, 6, 8] and m["stopped"] == "completed: 8 of 8 steps"
    assert m["best"] == {"metric": "val_loss", "mode": "min", "step": min(vals, key=vals.get),
                         "value": min(vals.values())}
    trained = load_file(str(art.path / "trained" / "model.safetensors"))
    last = load_file(str(art.path / "last" / "trainable.safetensors"))
    shared = sorted(set(trained) & set(last))
    assert len(shared) > 10
    same = all(torch.equal(trained[k], last[k]) for k in shared)
    assert m["best"]["step"] < 8 and not same  # trained/ holds the best step's weights, last/ the 8th step's
    plan = GRAPH.plan(load_pipeline("tiny-imdb", sets), open_store())
    text = render(plan.cfg, stage_rows(plan, open_store()))
    assert f"best: val_loss {m['best']['value']:.4f} at step {m['best']['step']} of 8" in text


def test_settings_that_cannot_work_stop_before_training(tmp_path):

    from stages.engine.errors import ConfigError, MissingInputError

    with pytest.raises(MissingInputError, match="train.select_best: there is no validation split"):
        train_model(tiny_classifier(), cls_rows(16), None, tcfg(max_steps=2, select_best={"metric": "val_loss"}),
                    "seq_cls", PAD, tmp_path / "o1", tmp_path / "w1", log)
    assert not (tmp_path / "w1" / "checkpoints").exists()
    from stages.graph import GRAPH
    from stages.pipeline.loading import load_pipeline

    with pytest.raises(ConfigError) as exc:  # refused at plan time, before anything runs
        GRAPH.validate(load_pipeline("tiny-billsum", ["train.select_best={metric: val_accuracy}"]))
    assert str(exc.value) == ("train.select_best.metric: validation of method seq2seq does not compute "
                              "val_accuracy; use one of val_loss, val_rouge1, val_rouge2, val_rougeL, val_rougeLsum, val_exact_match")
    with pytest.raises(ConfigError, match="does not compute val_rougeL; use one of val_loss, val_accuracy, "
                                          "val_macro_f1$"):
        GRAPH.validate(load_pipeline("tiny-imdb", ["train.select_best={metric: val_rougeL}"]))
    modes = {m: load_pipeline("tiny-imdb", [f"train.select_best={{metric: {m}}}"]).train.select_best.mode
             for m in ("val_loss", "val_accuracy", "val_macro_f1")}
    assert modes == {"val_loss": "min", "val_accuracy": "max", "val_macro_f1": "max"}


def macro_f1(preds: list[int], refs: list[int]) -> float:
    scores = []
    for c in sorted(set(preds) | set(refs)):
        tp = sum(p == c == r for p, r in zip(preds, refs, strict=True))
        fp, fn = sum(p == c != r for p, r in zip(preds, refs, strict=True)), sum(r == c != p for p, r in
                                                                                  zip(preds, refs, strict=True))
        scores.append(2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores)


@needs_shared_data
def test_select_best_on_validation_macro_f1_keeps_the_weights_that_score_it(store_dir):
    """val_macro_f1 is computed during training by the evaluate stage's f1 module (in the train key); the
    trained/ weights score the best value on the validation split, recomputed here by hand."""
    import datasets

    from stages.models.model_loading import load_trained

    sets = ["data.subset={train: 48, validation: 16, test: 8}", "train.max_steps=8", "train.lr=1e-2",
            "train.eval_every=2", "train.select_best={metric: val_macro_f1}"]
    out = run("tiny-imdb", *sets, until="train")
    art = out["train"]
    m = art.manifest["metrics"]
    vals = {v["step"]: v["val_macro_f1"] for v in m["validation"]}
    assert sorted(vals) == [2, 4, 6, 8] and all(0 <= v <= 1 for v in vals.values())
    assert m["best"] == {"metric": "val_macro_f1", "mode": "max", "step": max(vals, key=vals.get),
                         "value": max(vals.values())}
    assert any(k.startswith("f1/") for k in art.manifest["key_inputs"]["inputs"])  # the module is in the key
    model = load_trained(out["model"].path, out["adapters"].path, art.path).eval()
    val = datasets.load_from_disk(str(out["tokenize"].path / "dataset"))["validation"]
    with torch.no_grad():
        preds = [int(model(input_ids=torch.tensor([ids])).logits.argmax(-1)) for ids in val["input_ids"]]
    assert macro_f1(preds, list(val["labels"])) == pytest.approx(m["best"]["value"], abs=1e-6)


@needs_shared_data
def test_select_best_on_validation_rouge_for_a_summariser(store_dir):
    sets = ["train.max_steps=4", "train.eval_every=2", "train.select_best={metric: val_rougeL}",
            "tokenize.max_target_length=16"]
    m = run("tiny-billsum", *sets, until="train")["train"].manifest["metrics"]
    vals = {v["step"]: v["val_rougeL"] for v in m["validation"]}
    assert sorted(vals) == [2, 4] and all(0 <= v <= 1 for v in vals.values())
    assert all({"val_loss", "val_rouge1", "val_rouge2", "val_rougeLsum"} <= set(v) for v in m["validation"])
    assert m["best"]["metric"] == "val_rougeL" and m["best"]["mode"] == "max"
    assert m["best"]["value"] == max(vals.values())


def ddp_early(args: dict) -> dict:
    """Runs in each of two launched processes: EARLY as micro-batch 4 x 2 processes (the same effective batch
    of 8); rank 0 alone validates, so its early-stopping decision must reach the other process."""
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    model = tiny_classifier()
    m = train_model(model, cls_rows(64, seed=1), cls_rows(32, seed=2), tcfg(**{**EARLY, "micro_batch_size": 4}),
                    "seq_cls", PAD, Path(args["out"]), Path(args["work"]), log)
    if int(os.environ["RANK"]) == 0:
        save_file(trainable(model), args["weights"])
    return m


def test_two_processes_stop_early_together_with_the_same_best(tmp_path):
    from stages.training.distributed import launch

    torch.set_num_threads(1)
    ref, ref_weights = train_early(tmp_path / "ref-work", tmp_path / "ref-out")
    args = {"out": str(tmp_path / "out"), "work": str(tmp_path / "work"), "weights": str(tmp_path / "w.st")}
    m = launch("test_train_health:ddp_early", args, 2, tmp_path / "launch", log, pythonpath=[str(HERE), str(HERE.parent)])
    diff = max_diff(ref_weights, load_file(args["weights"]))
    print(f"2 processes: {m['stopped']}; best {m['best']}; max |w - w_1 process| = {diff:.1e}")
    assert m["best"] == ref["best"] and m["stopped"] == ref["stopped"] and m["steps"] == ref["steps"] < 200
    assert diff < 1e-4  # the best step's weights (gloo sums in another order than one process)
