"""Training health: a diverging run stopped with one clear line, the best evaluation's weights kept, and
early stopping.

Divergence (`Watchdog.check`, before each optimizer step, so a bad step never reaches the weights): a
non-finite loss, a non-finite gradient norm (except under an fp16 grad scaler, which skips such steps
itself: those are counted, and only `train.max_skipped_steps` of them in a row count as divergence), or
the loss averaged over the last SMOOTH_ROWS rows of training (ceil(SMOOTH_ROWS / effective batch) steps,
fewer at the start) above `train.divergence_factor` x its level: the median of the same average over the
HISTORY steps before that window, or the first step's loss when lower (an explosion in the first steps
would otherwise make its own level). Averaging first matters: late in a run with an effective batch of
one review, one confidently wrong review costs 100x the median loss without anything diverging; a mean
over 256 rows does not move like that unless training really went wrong.

Best weights (`BestKeeper`): each evaluation that improves `train.select_best.metric` writes the
trainable weights to work_dir/best/step-N.safetensors; every checkpoint hard-links the current best file,
so a resumed run finds the best-so-far of the moment it resumes from, with the patience counter in
TrainingProgress.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from stages.engine.errors import DivergenceError
from stages.training.checkpoint import (
    TrainingProgress,
    checkpoints,
    link_or_copy,
    load_trainable_state,
    trainable_state,
)

SMOOTH_ROWS = 256  # rows the loss is averaged over before it is compared
HISTORY = 100  # averaged values (steps) the level is the median of
FLOOR = 0.5  # nats: an averaged loss under this has not diverged (near zero, tenfold is still small)
FIX = ("lower train.lr, clip gradients (train.max_grad_norm, e.g. 1.0), or train in fp32 "
       "(train.mixed_precision=no)")


class Watchdog:
    def __init__(self, factor: float | None, max_skipped: int, scaled: bool, checkpoint_root: Path,
                 effective_batch: int):
        self.factor, self.max_skipped, self.scaled, self.root = factor, max_skipped, scaled, checkpoint_root
        self.smooth = max(1, math.ceil(SMOOTH_ROWS / effective_batch))  # steps averaged

    def check(self, progress: TrainingProgress, loss: float, grad_norm: float) -> None:
        """Raise DivergenceError when step progress.step + 1 diverged; else remember its loss."""
        step = progress.step + 1
        if not math.isfinite(loss):
            self.fail(step, f"the loss is {loss}")
        if not math.isfinite(grad_norm) and not self.scaled:
            self.fail(step, f"the gradient norm is {grad_norm} (loss {loss:.4g})")
        window, means = progress.recent_losses, progress.recent_means  # means: of whole windows only
        n = min(self.smooth, len(window) + 1)
        now = (math.fsum(window[len(window) - n + 1:]) + loss) / n
        if self.factor:
            earlier = means[:len(means) - (self.smooth - 1)][-HISTORY:]  # windows sharing no step with now's
            # until there are such, the first step's loss is the level (and bounds it later: an explosion
            # in the first steps would otherwise set the level itself)
            level = min(statistics.median(earlier) if earlier else math.inf, progress.first_loss or math.inf)
            if level < math.inf and now > max(self.factor * level, FLOOR):
                self.fail(step, f"the loss averaged over the last {n} steps is {now:.4g}, above "
                          f"train.divergence_factor {self.factor:g} x {level:.4g} (its running median, or the first "
                          f"step's loss when lower; this step's loss {loss:.4g})", before=step - self.smooth)
        window.append(loss)
        del window[:-self.smooth]
        if n == self.smooth:
            means.append(now)
            del means[:-(HISTORY + self.smooth)]

    def count_skip(self, progress: TrainingProgress, skipped: bool) -> None:
        """After the step: an fp16 grad scaler that skipped it (gradient overflow) is counted, and too many
        skips in a row mean the gradients are not finite at any scale."""
        if not skipped:
            progress.skipped_in_a_row = 0
            return
        progress.skipped_steps += 1
        progress.skipped_in_a_row += 1
        if progress.skipped_in_a_row > self.max_skipped:
            self.fail(progress.step, f"the fp16 grad scaler skipped {progress.skipped_in_a_row} steps in a row "
                      f"(gradient overflow; more than train.max_skipped_steps {self.max_skipped})")

    def fail(self, step: int, what: str, before: int | None = None) -> None:
        good = [p for s, p in checkpoints(self.root) if before is None or s <= before]
        where = f"the last good checkpoint is {good[-1]}" if good else "no checkpoint was written before it"
        raise DivergenceError(f"train: training diverged at step {step}: {what}; {where} (the work folder is kept "
                              f"for inspection, nothing was committed); fix: {FIX}")


class BestKeeper:
    """train.select_best and train.early_stopping, on rank 0 (which alone validates)."""

    def __init__(self, select: Any, early: Any, folder: Path):
        self.select, self.early, self.folder = select, early, folder

    @property
    def path(self) -> Path | None:
        found = sorted(self.folder.glob("step-*.safetensors")) if self.folder.is_dir() else []
        return found[-1] if found else None

    def restore(self, checkpoint: Path, progress: TrainingProgress) -> None:
        """Resuming from `checkpoint`: its best weights become the current best (a killed run may have
        found a later best that the resumed run will find again)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        if progress.best is not None and (checkpoint / "best.safetensors").is_file():
            self.folder.mkdir(parents=True)
            link_or_copy(checkpoint / "best.safetensors", self.folder / f"step-{progress.best['step']:06d}.safetensors")

    def update(self, progress: TrainingProgress, result: dict[str, float], model: torch.nn.Module) -> str:
        """After an evaluation: keep the weights when the metric improved, count evaluations without an
        improvement above early_stopping.min_delta, and set progress.stopped when patience runs out.
        Returns a note for the log line."""
        if self.select is None:
            return ""
        metric, mode = self.select.metric, self.select.mode
        value, best = result[metric], progress.best
        gain = math.inf if best is None else (value - best["value"]) * (1 if mode == "max" else -1)
        note = ""
        if gain > 0:
            self.save(model, progress.step)
            progress.best = {"metric": metric, "mode": mode, "step": progress.step, "value": value}
            note = " (best so far)"
        if self.early is None:
            return note
        if gain > self.early.min_delta:
            progress.evals_since_best = 0
        else:
            progress.evals_since_best += 1
        if progress.evals_since_best >= self.early.patience:
            b = progress.best
            assert b is not None  # set at the first evaluation
            progress.stopped = (f"early stopping at step {progress.step}: {metric} did not improve by more than "
                                f"{self.early.min_delta:g} for {self.early.patience} evaluations (best {b['value']:.4g} "
                                f"at step {b['step']})")
            note += f"; {progress.stopped}"
        return note

    def save(self, model: torch.nn.Module, step: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".tmp-step-{step:06d}.safetensors"
        save_file(trainable_state(model), str(tmp))
        os.replace(tmp, self.folder / f"step-{step:06d}.safetensors")
        for old in self.folder.glob("step-*.safetensors"):  # checkpoints keep their own links
            if old.name != f"step-{step:06d}.safetensors":
                old.unlink()

    def load_best(self, model: torch.nn.Module) -> None:
        assert self.path is not None
        load_trainable_state(model, load_file(str(self.path)))

