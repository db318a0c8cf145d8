"""Train stage: an explicit loop over a model made trainable by the adapters stage, torchtune's recipe shape.

    recipe = TrainRun(cfg, method, work_dir, log)  construct: the device, its precision, the processes
    recipe.setup(model, train, validation, ...)    _setup_model, _setup_optimizer, _setup_lr_scheduler, _setup_data,
                                                   _setup_progress (the resume checkpoint), _setup_run_log
    recipe.train()                                 the loop over optimizer steps: one step reads top to bottom there
    recipe.cleanup(out_dir)                        metrics and plot; select_best loads the best weights back

Setup: precision (`auto`: bf16 on GPUs that have it and on CPUs with bf16 units, fp16 + grad scaler on older
GPUs, else fp32; resolved before any key, so the key holds the precision used) and accelerate's Accelerator
(stages/training/device.py), the optimizer (stages/training/optim.py's table) and schedule, the latest resume
checkpoint. Settings that cannot work are refused at plan time, before any stage runs (train_checks.py).

Each optimizer step takes one *effective batch* (micro_batch_size x gradient_accumulation_steps rows, chosen
by a seeded length-grouped sampler: stages/training/batching.py), cuts it into micro-batches padded to their
own longest row, and runs forward/backward on each. The loss is a *sum* divided by the count over the whole
effective batch (rows for classify, target tokens for seq2seq / sft: the method's, stages/methods/), so
micro-batch k x accumulation 1 and micro-batch 1 x accumulation k give the same gradients (transformers'
Trainer instead scales by the number of micro-batches). A CUDA out-of-memory error halves the micro-batch and
doubles accumulation (the same effective batch) and retries the step. Before the optimizer step the gradient
norm is measured (and clipped) and the step checked for divergence; validation runs at each epoch end and
every `train.eval_every` steps, and may keep the best weights and stop early (stages/training/health.py). What
the run shows and leaves: stages/training/runlog.py. Ctrl-C / SIGTERM: a checkpoint at the last finished step,
then the signal (stages/training/interrupt.py).

Several processes (train.num_processes > 1): `run` starts itself under `accelerate launch` (stages/
training/distributed.py), one process per GPU (gloo processes on CPU). Effective batch = micro-batch x
accumulation x processes; every process takes its shard of each effective batch, the loss denominator is
the count over the whole global batch and DDP averages the gradients (TrainRun.window: one window for 1 and N processes), so the
weights equal one process's with accumulation x processes. Rank 0 alone validates, logs, checkpoints and
writes the artifact; its checkpoints and resume point reach a shared store through the stage's own process
(distributed.hand_over) while the other ranks wait at a barrier. The OOM back-off is off there (one process
cannot retry alone).

Several machines (train.num_machines > 1): each runs the pipeline with its own train.machine_rank; they meet
at machine 0's main_process_ip:port (torchrun's rendezvous). Global rank 0 alone writes; the others run the
stage outside the store (Stage.joins) and stop after it. Machine 0's rank 0 sends them its resume checkpoint,
and its checkpoints are published by machine 0's stage, as with one machine.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from stages.engine.errors import ConfigError, MissingInputError
from stages.engine.stage import StageContext
from stages.methods.registry import method_of
from stages.models.hf import load_tokenizer
from stages.models.model_loading import count_parameters, load_trainable, save_trained
from stages.pipeline.schema import MethodConfig, TrainConfig, method_settings
from stages.text.packing import keeps_rows_apart
from stages.training import distributed
from stages.training.batching import Rows, epoch_batches, shard, validation_rows
from stages.training.checkpoint import (
    TrainingProgress,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    trainable_state,
)
from stages.training.device import (
    enable_gradient_checkpointing,
    is_oom,
    make_accelerator,
    release_memory,
    seed_everything,
    upcast_trainable,
)
from stages.training.health import BestKeeper, Watchdog
from stages.training.interrupt import DeferredStop, StepAbandoned
from stages.training.optim import OPTIMIZERS, lr_factor
from stages.training.runlog import NoRunLog, RunLog
from stages.training.train_checks import check_validation

# ====================================================================== the stage

def run(ctx: StageContext) -> dict[str, Any]:
    method, tcfg = ctx.cfg.method, ctx.cfg.train
    if tcfg.num_processes > 1 or tcfg.num_machines > 1:  # the same body, once per process, under `accelerate launch`
        return launch_training(method, tcfg, ctx.upstream, ctx.out_dir, ctx.work_dir, ctx.log)
    return train_stage(method, tcfg, ctx.upstream, ctx.out_dir, ctx.work_dir, ctx.log)


def train_stage(method: MethodConfig, tcfg: TrainConfig, upstream: dict[str, Path], out_dir: Path, work_dir: Path,
                log: logging.Logger) -> dict[str, Any]:
    import datasets

    tok_dir = upstream["tokenize"]
    ds = datasets.load_from_disk(str(tok_dir / "dataset"))
    tokenizer = load_tokenizer(tok_dir / "tokenizer")
    model = load_trainable(upstream["model"], upstream["adapters"], gradient_checkpointing=tcfg.gradient_checkpointing)
    result = train_model(model, ds["train"], ds["validation"] if "validation" in ds else None, tcfg, method,
                         tokenizer.pad_token_id, out_dir, work_dir, log, tokenizer=tokenizer)
    if distributed_rank() == 0:  # only rank 0 writes the artifact (0 without a process group)
        save_trained(model, out_dir / "trained", upstream["model"])
    return result


def train_model(model: torch.nn.Module, train_ds: Any, val_ds: Any, tcfg: TrainConfig, method: MethodConfig | str,
                pad_id: int,
                out_dir: Path, work_dir: Path, log: logging.Logger, *, tokenizer: Any = None) -> dict[str, Any]:
    """Train `model` in place on the tokenized `train_ds` (with train.select_best: left holding the best
    validation's weights); write metrics.jsonl, tensorboard/ and loss.png to out_dir; resume from (and
    checkpoint to) work_dir/checkpoints. Returns the manifest metrics (`tokenizer`: for a ROUGE select_best).
    Under `accelerate launch` (N processes) each trains on its shard of every effective batch; only rank 0
    validates, logs and writes."""
    recipe = TrainRun(tcfg, method, work_dir, log)
    recipe.setup(model, train_ds, val_ds, pad_id, tokenizer)
    recipe.train()
    return recipe.cleanup(out_dir)


class TrainRun:
    """One training run, torchtune's recipe shape: construct, setup(), train(), cleanup()."""

    def __init__(self, cfg: TrainConfig, method: MethodConfig | str, work_dir: Path, log: logging.Logger):
        self.cfg = cfg
        self.method = method_of(method) if isinstance(method, str) else method_of(method.name).bound(method)
        self.log = log
        self.work_dir = work_dir
        self.ckpt_dir = work_dir / "checkpoints"
        self.accelerator, self.precision = make_accelerator(cfg.mixed_precision, log)
        self.device = self.accelerator.device
        self.world = self.accelerator.num_processes  # all of them, on all machines
        self.is_main = self.accelerator.is_main_process
        # torchrun's: the processes on this machine (accelerate launch --num_machines M starts world / M each)
        self.machines = self.world // int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.effective = cfg.micro_batch_size * cfg.gradient_accumulation_steps * self.world  # rows per step
        self.stop = DeferredStop(enabled=self.world == 1)  # Ctrl-C / SIGTERM: see stop_here

    # ------------------------------------------------------------------ setup
    def setup(self, model: torch.nn.Module, train_ds: Any, val_ds: Any, pad_id: int, tokenizer: Any = None) -> None:
        cfg = self.cfg
        self.rows = self._setup_data(train_ds, pad_id)
        self.pad_id = pad_id
        self.val_rows = self._setup_validation(val_ds, cfg.eval_max_examples)
        self.tokenizer = tokenizer  # a ROUGE select_best decodes the generated text
        self.steps_per_epoch = math.ceil(len(self.rows) / self.effective)
        self.total_steps = cfg.max_steps or math.ceil(cfg.epochs * self.steps_per_epoch)
        model = self._setup_model(model, upcast=self.precision.name != "no",
                                  gradient_checkpointing=cfg.gradient_checkpointing)
        optimizer = self._setup_optimizer(model, cfg.optimizer, cfg.lr, cfg.weight_decay)
        self.lr_scheduler = self._setup_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.warmup_steps, self.total_steps)
        seed_everything(cfg.seed)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.core = self.accelerator.unwrap_model(self.model)  # DDP's module (the model itself in one process)
        if self.rows.packed:
            self._check_packing(self.core)
        self.keeper = BestKeeper(cfg.select_best, cfg.early_stopping, self.work_dir / "best")
        self.progress = self._setup_progress(cfg.micro_batch_size)
        self.resumed_from = self.progress.step or None  # a checkpoint's step is >= 1
        self.saved_step = self.resumed_from  # the step of the newest checkpoint on disk
        self.watchdog = Watchdog(cfg.divergence_factor, cfg.max_skipped_steps, self.accelerator.scaler is not None,
                                 self.ckpt_dir, self.effective)
        self.runlog = self._setup_run_log(self.progress.step)
        self.last_loss: float | None = None
        trainable, total = count_parameters(self.core)
        self.log.info("train: %d examples, effective batch %d = micro-batch %d x accumulation %d%s, %d steps/epoch, "
                      "%d steps; %s lr %.2g; %d trainable of %d params (%.2f%%)", len(self.rows), self.effective,
                      cfg.micro_batch_size, cfg.gradient_accumulation_steps,
                      f" x {self.world} processes" if self.world > 1 else "", self.steps_per_epoch,
                      self.total_steps, cfg.optimizer, cfg.lr, trainable, total, 100 * trainable / max(total, 1))

    def _setup_data(self, train_ds: Any, pad_id: int | None) -> Rows:
        if pad_id is None:
            raise MissingInputError("train: the tokenizer has no pad token; the tokenize stage should set one")
        rows = Rows(train_ds)
        if not len(rows):
            raise MissingInputError("train: the train split is empty; check data.subset / data.split")
        return rows

    def _check_packing(self, model: torch.nn.Module) -> None:
        """Packed rows (tokenize.packing) need a model whose attention keeps them apart given their position
        ids (stages/text/packing.py); one that does not is refused before the first step."""
        if not keeps_rows_apart(model, self.device):
            raise ConfigError(f"tokenize.packing: this model ({type(model).__name__}) lets packed rows attend to "
                              "each other (its attention does not follow position ids); set tokenize.packing: false")

    def _setup_validation(self, val_ds: Any, max_examples: int | None) -> Rows | None:
        """The validation rows (None: none). Planning refused settings that need them where the data config
        makes none (train_checks); a split that turned out empty is refused here."""
        val_rows = validation_rows(val_ds, max_examples)
        check_validation(self.cfg, val_rows is not None, MissingInputError)
        return val_rows

    def _setup_model(self, model: torch.nn.Module, *, upcast: bool, gradient_checkpointing: bool) -> torch.nn.Module:
        if upcast:  # mixed precision: fp32 master weights
            upcast_trainable(model, self.log)
        if gradient_checkpointing:
            enable_gradient_checkpointing(model, self.log)
        model.train()
        return model

    def _setup_optimizer(self, model: torch.nn.Module, name: str, lr: float,
                         weight_decay: float) -> torch.optim.Optimizer:
        """optim.OPTIMIZERS[name] over the trainable parameters; weight decay applies to matrices only, not to
        biases and norm weights (nanoGPT)."""
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise MissingInputError("train: the model has no trainable parameters; check the adapters stage "
                                    "(adapters.method, adapters.target_modules)")
        groups = [g for g in ({"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}) if g["params"]]
        return OPTIMIZERS[name](groups, lr, self.device, self.log)

    def _setup_lr_scheduler(self, optimizer: torch.optim.Optimizer, schedule: str, warmup: int,
                            total: int) -> torch.optim.lr_scheduler.LambdaLR:
        def factor(step: int) -> float:  # a plain function: the scheduler's state_dict stays tensors/numbers
            return lr_factor(step, schedule, warmup, total)

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def _setup_progress(self, micro_batch_size: int) -> TrainingProgress:
        """Where training stands: the latest resume checkpoint's progress (its weights, optimizer, schedule,
        RNG and best weights loaded), or a fresh start."""
        ckpt = latest_checkpoint(self.ckpt_dir)
        if self.machines > 1:  # rank 0's checkpoint for every process: the other machines do not see its disk
            ckpt = distributed.share_folder(ckpt if self.is_main else None,
                                            self.work_dir / "received" / f"rank-{self.accelerator.process_index}",
                                            self.device)
        if ckpt is None:
            return TrainingProgress(micro_batch_size=micro_batch_size)
        progress = load_checkpoint(ckpt, self.core, self.optimizer, self.lr_scheduler, self.accelerator.scaler)
        if self.is_main:  # the one process that keeps the best weights
            self.keeper.restore(ckpt, progress)
        self.log.info("train: resumed from step %d (epoch %d, batch %d of the epoch) - checkpoint %s",
                      progress.step, progress.epoch + 1, progress.batches_done, ckpt.name)
        return progress

    def _setup_run_log(self, step: int) -> RunLog | NoRunLog:
        if self.is_main:
            return RunLog(self.work_dir / "logs", step, self.log, self.total_steps)
        return NoRunLog(self.log)

    # ------------------------------------------------------------------ the loop: one optimizer step, top to bottom
    def train(self) -> None:
        """The loop over optimizer steps, one effective batch each, epoch by epoch (each its own order)."""
        p, cfg = self.progress, self.cfg
        with self.stop, contextlib.closing(self.runlog):
            while p.step < self.total_steps and p.stopped is None:
                plan = epoch_batches(self.rows.lengths, self.effective, cfg.seed, p.epoch, cfg.group_by_length)
                while p.batches_done < len(plan) and p.step < self.total_steps:
                    idx, t0 = plan[p.batches_done], time.perf_counter()
                    self.stop.step_starts()
                    # 1. the window: forward and backward of each micro-batch, its summed loss divided by the
                    # units of the whole effective batch (rows, target tokens, pairs), so k x 1 == 1 x k
                    try:
                        loss, real, padded, stats = self.window(idx)
                    except StepAbandoned:  # the step never happened: no gradients, the RNG as at its start
                        self.stop.rewind(self.optimizer)
                        self.stop_here()
                        continue  # the handler let the run go on: the step again
                    except RuntimeError as err:  # out of memory: the same step in half the micro-batch
                        # (across processes one rank cannot retry alone: the others wait in the all-reduce)
                        if not is_oom(err) or p.micro_batch_size == 1 or self.world > 1:
                            raise
                        self.halve_micro_batch()
                        continue
                    # 2. clip: the gradients' norm before clipping (gradients a grad scaler multiplied are
                    # unscaled first; its step then does not unscale them twice)
                    if cfg.max_grad_norm:
                        norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm))
                    else:
                        if self.accelerator.scaler is not None:
                            self.accelerator.unscale_gradients()
                        grads = [q.grad for q in self.model.parameters() if q.grad is not None]
                        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
                    # 3. the health check, before the step: a diverged step never reaches the weights
                    self.watchdog.check(p, loss, norm)
                    # 4. step, schedule, clear the gradients (an fp16 grad scaler skips a step that overflowed)
                    self.optimizer.step()
                    skipped = self.accelerator.optimizer_step_was_skipped
                    if not skipped:
                        self.lr_scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    self.watchdog.count_skip(p, skipped)
                    # 5. record it; validate at the epoch's end and every eval_every steps; checkpoint
                    self.record_step(loss, real, padded, norm, time.perf_counter() - t0, len(plan), stats)
                    epoch_end = p.batches_done == len(plan)
                    if epoch_end or (cfg.eval_every and p.step % cfg.eval_every == 0):
                        self.validate()
                    if epoch_end:
                        p.epoch, p.batches_done = p.epoch + 1, 0
                    if p.step % cfg.checkpoint_every == 0 or p.step == self.total_steps or p.stopped:
                        self.checkpoint()
                    self.stop_here()
                    if epoch_end or p.stopped:
                        break  # the next epoch has its own order
            # ended mid-epoch, not on an evaluation: the last weights are validated too (decided alike on
            # every rank: validate() broadcasts across processes)
            if p.batches_done and p.stopped is None and not (cfg.eval_every and p.step % cfg.eval_every == 0):
                self.validate()
            self.stop_here()  # a signal during that validation

    def window(self, idx: list[int]) -> tuple[float, int, int, dict[str, float]]:
        """One effective batch, forward and backward: the one accumulation window, for 1 and N processes
        (nanoGPT's). Each process takes its share of the rows (batching.shard; all of them in one process), the
        method prepares each micro-batch and steps it; each summed loss is divided by the units of the whole
        effective batch, counted over every process, and multiplied by the number of processes before backward,
        because DDP *averages* gradients: the all-reduced gradient is then exactly that of the loss averaged over
        the effective batch, as in one process. Gradients are all-reduced once, on the last micro-batch.
        Returns the loss, the real and padded tokens, and the method's stats, each a mean over the units."""
        p, acc, world, method = self.progress, self.accelerator, self.world, self.method
        mine = shard(idx, self.rows.lengths, acc.process_index, world)
        micro = [method.prepare(self.model, mb.to(self.device), p.step)
                 for mb in self.rows.batches(mine, p.micro_batch_size, self.pad_id, method)] if mine else []
        units = sum(mb.units for mb in micro)
        if world > 1:
            units = int(acc.reduce(torch.tensor([units], device=self.device), reduction="sum").item())
        units = max(units, 1)
        # a short last batch with fewer rows than processes leaves this one none: a zero-weight pass over one
        # row keeps DDP's all-reduce in step
        passes = micro or [self.rows.batches(idx[:1], 1, self.pad_id, method)[0].to(self.device)]
        scale = float(world) if micro else 0.0
        total = torch.zeros((), device=self.device)  # read once per step: keeps a GPU busy
        stats: dict[str, float] = {}
        for k, mb in enumerate(passes):
            self.stop.check()  # a stop signal abandons the step here
            with acc.no_sync(self.model) if k < len(passes) - 1 else contextlib.nullcontext():
                out = method.step(self.model, mb)
                loss = out.loss_sum / units
                acc.backward(loss * scale)
            total += loss.detach().float()
            for name, value in out.stats.items():
                stats[name] = stats.get(name, 0.0) + float(value) * (scale / world)
        sums = [float(total) if micro else 0.0, sum(mb.real_tokens for mb in micro),
                sum(mb.padded_tokens for mb in micro), *(stats[k] for k in sorted(stats))]
        if world > 1:
            sums = acc.reduce(torch.tensor(sums, dtype=torch.float64, device=self.device), reduction="sum").tolist()
        return (sums[0], int(sums[1]), int(sums[2]),
                {k: v / units for k, v in zip(sorted(stats), sums[3:], strict=True)})

    def halve_micro_batch(self) -> None:
        """After a CUDA out-of-memory error: half the micro-batch, twice the accumulation (the effective batch
        unchanged), the failed step's gradients and cached memory dropped."""
        p, old = self.progress, self.progress.micro_batch_size
        self.optimizer.zero_grad(set_to_none=True)
        release_memory()
        p.micro_batch_size = old // 2
        self.runlog.emit(logging.WARNING, "train: out of memory at step %d: micro-batch %d -> %d, accumulation "
                         "%d -> %d (effective batch %d unchanged); retrying the step", p.step + 1, old,
                         p.micro_batch_size, math.ceil(self.effective / old),
                         math.ceil(self.effective / p.micro_batch_size), self.effective)

    def stop_here(self) -> None:
        """After a stop signal: a checkpoint at the last finished step, then the signal's own handler."""
        p = self.progress
        if not self.stop.requested:
            return
        if p.step and self.saved_step != p.step:
            self.checkpoint()
        self.runlog.emit(logging.WARNING, "train: %s at step %d of %d: %s", self.stop.name, p.step, self.total_steps,
                         f"checkpoint {self.ckpt_dir / f'step-{p.step:06d}'}; the next run resumes from it" if p.step
                         else "no step finished yet, nothing to save")
        self.stop.deliver()

    def record_step(self, loss: float, real: int, padded: int, norm: float, elapsed: float, batches: int,
                    stats: dict[str, float]) -> None:
        p = self.progress
        p.step += 1
        p.batches_done += 1
        p.real_tokens += real
        p.padded_tokens += padded
        p.train_seconds += elapsed
        if p.first_loss is None:  # kept in the checkpoint: a resumed run reports the run's first loss
            p.first_loss = loss
        self.last_loss = loss
        lr = self.lr_scheduler.get_last_lr()[0]
        rec = {"kind": "train", "step": p.step, "epoch": p.epoch + 1, "loss": round(loss, 6), "lr": lr,
               "real_tokens": real, "padded_tokens": padded, "tokens_per_s": round(real / elapsed, 1),
               "micro_batch_size": p.micro_batch_size, "grad_norm": round(norm, 6),
               **{k: round(v, 6) for k, v in stats.items()}}
        if self.accelerator.scaler is not None:
            rec["skipped_steps"] = p.skipped_steps
        self.runlog.train_step(rec, line=p.step % self.cfg.log_every == 0 or p.step == self.total_steps,
                               batch=p.batches_done, batches=batches, total=self.total_steps,
                               tok_s=p.real_tokens / max(p.train_seconds, 1e-9),
                               padding=1 - p.real_tokens / max(p.padded_tokens, 1), skipped=p.skipped_steps)

    # ------------------------------------------------------------------ validation and checkpoints
    def validate(self) -> None:
        """Rank 0 validates (no grads: twice the micro-batch fits), may keep the weights as the best and
        decide to stop early; across processes that decision is broadcast to every rank."""
        p = self.progress
        if self.is_main and self.val_rows is not None:
            res = self.method.validate(self.core, self.val_rows, self.pad_id, 2 * p.micro_batch_size, self.device,
                                getattr(self.cfg.select_best, "metric", None), self.tokenizer)
            rec = {"kind": "validation", "step": p.step, "epoch": p.epoch + 1, **res}
            p.history.append(rec)
            note = self.keeper.update(p, res, self.core)
            self.runlog.validation(rec, note)
            if p.best is not None and p.best["step"] == p.step:
                self.runlog.write({"kind": "best", **p.best})
        if self.world > 1 and self.cfg.early_stopping is not None:
            from accelerate.utils import broadcast

            flag = broadcast(torch.tensor([int(p.stopped is not None)], device=self.device), from_process=0)
            if int(flag.item()) and p.stopped is None:
                p.stopped = "early stopping (decided on rank 0)"

    def checkpoint(self) -> None:
        if self.is_main:
            best = self.keeper.path if self.progress.best is not None else None
            save_checkpoint(self.ckpt_dir, self.progress, self.core, self.optimizer, self.lr_scheduler,
                            self.accelerator.scaler, self.cfg.keep_checkpoints,
                            links={"best.safetensors": best} if best else None, of=self.total_steps)
        if self.world > 1:  # the others wait while rank 0 saves it and its launcher publishes it
            self.accelerator.wait_for_everyone()
        self.saved_step = self.progress.step

    # ------------------------------------------------------------------ cleanup
    def cleanup(self, out_dir: Path) -> dict[str, Any]:
        """Metrics, TensorBoard and plot into out_dir; with select_best the best weights back in the model
        (the last beside them, in last/). Returns the manifest metrics."""
        p, cfg, scaler = self.progress, self.cfg, self.accelerator.scaler
        self.runlog.export(out_dir, metric_axis=cfg.eval_every is not None or cfg.select_best is not None)
        if self.is_main and p.best is not None:  # the artifact's weights are the best; the last ones beside them
            (out_dir / "last").mkdir(parents=True, exist_ok=True)
            save_file(trainable_state(self.core), str(out_dir / "last" / "trainable.safetensors"))
            self.keeper.load_best(self.core)
        trainable, total = count_parameters(self.core)
        self.accelerator.unwrap_model(self.model, keep_fp32_wrapper=False)
        self.accelerator.free_memory()
        health: dict[str, Any] = {"stopped": p.stopped or f"completed: {p.step} of {self.total_steps} steps"}
        if p.best is not None:
            health.update(best=p.best, last_step=p.step)
        if scaler is not None:
            health["skipped_steps"] = p.skipped_steps
        return {
            "steps": p.step,
            "epochs_done": round(p.epoch + p.batches_done / max(self.steps_per_epoch, 1), 4),
            "examples": len(self.rows),
            "effective_batch": self.effective,  # micro_batch_size x gradient_accumulation_steps x num_processes
            "micro_batch_size": p.micro_batch_size,
            "gradient_accumulation_steps": math.ceil(self.effective / (p.micro_batch_size * self.world)),
            "num_processes": self.world,  # all of them, on all machines
            "num_machines": self.machines,
            "precision": self.precision.name,
            "precision_reason": self.precision.reason,
            "optimizer": cfg.optimizer,
            "trainable_params": trainable,
            "total_params": total,
            "real_tokens": p.real_tokens,
            "padded_tokens": p.padded_tokens,
            "padding_share": round(1 - p.real_tokens / max(p.padded_tokens, 1), 4),
            "tokens_per_s": round(p.real_tokens / max(p.train_seconds, 1e-9), 1),
            "train_seconds": round(p.train_seconds, 3),
            "first_loss": p.first_loss,
            "final_loss": self.last_loss,
            "validation": p.history,
            "resumed_from_step": self.resumed_from,
            **health,
        }


def distributed_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def launch_training(method: MethodConfig, tcfg: TrainConfig, upstream: dict[str, Path], out_dir: Path, work_dir: Path,
                    log: logging.Logger) -> dict[str, Any]:
    """train.num_processes > 1: run `train_worker` in that many processes (one per GPU; gloo processes on
    a CPU-only machine) under `accelerate launch`, owned and awaited by this stage. Rank 0 writes
    checkpoints into work_dir and the artifact into out_dir, which are passed down as they are."""
    args = {"method": method.model_dump(mode="json"), "train": tcfg.model_dump(mode="json"), "upstream": {k: str(v) for k, v in upstream.items()},
            "out_dir": str(out_dir), "work_dir": str(work_dir)}
    return distributed.launch("stages.train:train_worker", args, tcfg.num_processes, work_dir / "launch", log,
                              port=tcfg.main_process_port, config_file=tcfg.accelerate_config, what="train",
                              num_machines=tcfg.num_machines, machine_rank=tcfg.machine_rank,
                              main_process_ip=tcfg.main_process_ip)


def train_worker(args: dict[str, Any]) -> dict[str, Any]:
    """One of the launched processes (stages.training.distributed runs it; rank 0's return value is the stage's)."""
    if torch.cuda.is_available():  # before loading: a quantized model goes to the current device (model.load_model)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return train_stage(method_settings(args["method"]["name"]).model_validate(args["method"]), TrainConfig(**args["train"]), {k: Path(v) for k, v in args["upstream"].items()},
                       Path(args["out_dir"]), Path(args["work_dir"]), logging.getLogger("finetune.train"))
