"""Train stage: an explicit loop over a model made trainable by the adapters stage.

    setup (TrainRun.__init__)  ->  loop over optimizer steps (TrainRun.train)  ->  cleanup (TrainRun.finish)
Setup: precision (`auto`: bf16 on GPUs that have it and on CPUs with bf16 units, fp16 + grad scaler on older
GPUs, else fp32; resolved before any key, so the key holds the precision used) and accelerate's Accelerator
(stages/common/device.py), optimizer and schedule (stages/common/optim.py), the latest resume checkpoint.

Loop: each optimizer step takes one *effective batch* (micro_batch_size x gradient_accumulation_steps
rows, chosen by a seeded length-grouped sampler: stages/common/batching.py), cuts it into micro-batches
padded to their own longest row, and runs forward/backward on each. The loss is a *sum* divided by the
count over the whole effective batch (rows for classification, target tokens for LM tasks:
stages/common/losses.py), so micro-batch k x accumulation 1 and micro-batch 1 x accumulation k give the
same gradients (transformers' Trainer instead scales by the number of micro-batches). A CUDA
out-of-memory error halves the micro-batch and doubles accumulation (the same effective batch) and
retries the step. Before each optimizer step the gradient norm is measured and the step checked for
divergence; validation runs at each epoch end and every `train.eval_every` steps, and may keep the best
weights and stop early (stages/common/health.py). What the run shows and leaves: stages/common/runlog.py.
Ctrl-C / SIGTERM: a checkpoint at the last finished step, then the signal (stages/common/interrupt.py).

Cleanup: metrics and plot; select_best loads the best weights back (the last in last/).

Several processes (train.num_processes > 1): `run` starts itself under `accelerate launch` (stages/
common/distributed.py), one process per GPU (gloo processes on CPU). Effective batch = micro-batch x
accumulation x processes; every process takes its shard of each effective batch, the loss denominator is
the count over the whole global batch and DDP averages the gradients (shard_window), so the weights equal
one process's with accumulation x processes. Rank 0 alone validates, logs, checkpoints and writes the
artifact. The OOM back-off is off there (one process cannot retry alone).

Several machines (train.num_machines > 1): each runs the pipeline with its own train.machine_rank; they meet
at machine 0's main_process_ip:port (torchrun's rendezvous). Global rank 0 alone writes; the others run the
stage outside the store (Stage.joins) and stop after it. Machine 0's rank 0 sends them its resume checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from stages.common import distributed
from stages.common.batching import Rows, epoch_batches, shard
from stages.common.checkpoint import (
    TrainingProgress,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    trainable_state,
)
from stages.common.device import (
    enable_gradient_checkpointing,
    is_oom,
    make_accelerator,
    release_memory,
    seed_everything,
    upcast_trainable,
)
from stages.common.health import BestKeeper, Watchdog, check_settings
from stages.common.hf import load_tokenizer
from stages.common.interrupt import DeferredStop, StepAbandoned
from stages.common.losses import accumulate_window, loss_units
from stages.common.model_loading import count_parameters, load_trainable, save_trained
from stages.common.optim import grad_norm, make_optimizer, make_scheduler
from stages.common.runlog import NoRunLog, RunLog
from stages.common.validation import evaluate_loss, validation_rows
from stages.engine.errors import ConfigError, MissingInputError
from stages.engine.schema import TrainConfig
from stages.engine.stage import StageContext

TASKS = ("seq_cls", "seq2seq", "causal_lm")


# ====================================================================== the stage

def run(ctx: StageContext) -> dict[str, Any]:
    task, tcfg = ctx.cfg.model.task, ctx.cfg.train
    if tcfg.num_processes > 1 or tcfg.num_machines > 1:  # the same body, once per process, under `accelerate launch`
        return launch_training(task, tcfg, ctx.upstream, ctx.out_dir, ctx.work_dir, ctx.log)
    return train_stage(task, tcfg, ctx.upstream, ctx.out_dir, ctx.work_dir, ctx.log)


def train_stage(task: str, tcfg: TrainConfig, upstream: dict[str, Path], out_dir: Path, work_dir: Path,
                log: logging.Logger) -> dict[str, Any]:
    import datasets

    tok_dir = upstream["tokenize"]
    ds = datasets.load_from_disk(str(tok_dir / "dataset"))
    tokenizer = load_tokenizer(tok_dir / "tokenizer")
    model = load_trainable(upstream["model"], upstream["adapters"], gradient_checkpointing=tcfg.gradient_checkpointing)
    result = train_model(model, ds["train"], ds["validation"] if "validation" in ds else None, tcfg, task,
                         tokenizer.pad_token_id, out_dir, work_dir, log, tokenizer=tokenizer)
    if distributed_rank() == 0:  # only rank 0 writes the artifact (0 without a process group)
        save_trained(model, out_dir / "trained", upstream["model"])
    return result


def train_model(model: torch.nn.Module, train_ds: Any, val_ds: Any, tcfg: TrainConfig, task: str, pad_id: int,
                out_dir: Path, work_dir: Path, log: logging.Logger, *, on_step: Any = None,
                tokenizer: Any = None) -> dict[str, Any]:
    """Train `model` in place on the tokenized `train_ds` (with train.select_best: left holding the best
    validation's weights); write metrics.jsonl, tensorboard/ and loss.png to out_dir; resume from (and
    checkpoint to) work_dir/checkpoints. Returns the manifest metrics. `on_step(step, loss)` is a test
    hook called after every optimizer step (`tokenizer`: for a ROUGE select_best). Under `accelerate launch`
    (N processes) each trains on its shard of every effective batch; only rank 0 validates, logs and writes."""
    trainer = TrainRun(model, train_ds, val_ds, tcfg, task, pad_id, work_dir, log, on_step, tokenizer)
    trainer.train()
    return trainer.finish(out_dir)


class TrainRun:
    """One training run, torchtune's recipe shape: setup here, then train(), then finish()."""

    def __init__(self, model: torch.nn.Module, train_ds: Any, val_ds: Any, tcfg: TrainConfig, task: str, pad_id: int,
                 work_dir: Path, log: logging.Logger, on_step: Any = None, tokenizer: Any = None):
        if task not in TASKS:
            raise ConfigError(f"model.task: {task!r} is not one of {TASKS}")
        if pad_id is None:
            raise MissingInputError("train: the tokenizer has no pad token; the tokenize stage should set one")
        self.tcfg, self.task, self.pad_id, self.log, self.on_step, self.tokenizer = (tcfg, task, pad_id, log,
                                                                                     on_step, tokenizer)
        self.accelerator, self.precision = make_accelerator(tcfg.mixed_precision, log)
        self.device, self.world = self.accelerator.device, self.accelerator.num_processes
        self.is_main = self.accelerator.is_main_process
        # torchrun's: the processes on this machine (accelerate launch --num_machines M starts world / M each)
        self.machines = self.world // int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        if self.precision.name != "no":
            upcast_trainable(model, log)
        if tcfg.gradient_checkpointing:
            enable_gradient_checkpointing(model, log)
        self.rows = Rows(train_ds)
        if not len(self.rows):
            raise MissingInputError("train: the train split is empty; check data.subset / data.split")
        self.val_rows = validation_rows(val_ds, tcfg.eval_max_examples)
        check_settings(tcfg, task, self.val_rows is not None)
        self.effective = tcfg.micro_batch_size * tcfg.gradient_accumulation_steps * self.world
        self.steps_per_epoch = math.ceil(len(self.rows) / self.effective)
        self.total_steps = tcfg.max_steps or math.ceil(tcfg.epochs * self.steps_per_epoch)
        optimizer = make_optimizer(model, tcfg.optimizer, tcfg.lr, tcfg.weight_decay, self.device, log)
        self.scheduler = make_scheduler(optimizer, tcfg.lr_scheduler, tcfg.warmup_steps, self.total_steps)
        seed_everything(tcfg.seed)
        model.train()
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.scaler = self.accelerator.scaler  # None unless fp16
        self.core = self.accelerator.unwrap_model(self.model)  # DDP's module (the model itself in one process)
        self.ckpt_dir = work_dir / "checkpoints"
        self.keeper = BestKeeper(tcfg.select_best, tcfg.early_stopping, work_dir / "best")
        self.progress, self.resumed_from = TrainingProgress(micro_batch_size=tcfg.micro_batch_size), None
        ckpt = latest_checkpoint(self.ckpt_dir)
        if self.machines > 1:  # rank 0's checkpoint for every process: the other machines do not see its disk
            ckpt = distributed.share_folder(ckpt if self.is_main else None,
                                            work_dir / "received" / f"rank-{self.accelerator.process_index}",
                                            self.device)
        if ckpt is not None:
            self.progress = load_checkpoint(ckpt, self.core, self.optimizer, self.scheduler, self.scaler)
            if self.is_main:  # the one process that keeps the best weights
                self.keeper.restore(ckpt, self.progress)
            self.resumed_from = self.progress.step
            log.info("train: resumed from step %d (epoch %d, batch %d of the epoch) - checkpoint %s",
                     self.progress.step, self.progress.epoch + 1, self.progress.batches_done, ckpt.name)
        self.watchdog = Watchdog(tcfg.divergence_factor, tcfg.max_skipped_steps, self.scaler is not None,
                                 self.ckpt_dir, self.effective)
        self.saved_step = self.resumed_from  # the step of the newest checkpoint on disk
        self.stop = DeferredStop(enabled=self.world == 1)  # Ctrl-C / SIGTERM: see stop_here
        self.runlog = (RunLog(work_dir / "logs", self.progress.step, log, self.total_steps) if self.is_main
                       else NoRunLog(log))
        self.last_loss: float | None = None
        self.n_trainable, self.n_total = count_parameters(model)
        log.info("train: %d examples, effective batch %d = micro-batch %d x accumulation %d%s, %d steps/epoch, "
                 "%d steps; %s lr %.2g; %d trainable of %d params (%.2f%%)", len(self.rows), self.effective,
                 tcfg.micro_batch_size, tcfg.gradient_accumulation_steps,
                 f" x {self.world} processes" if self.world > 1 else "", self.steps_per_epoch, self.total_steps,
                 tcfg.optimizer, tcfg.lr, self.n_trainable, self.n_total,
                 100 * self.n_trainable / max(self.n_total, 1))

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        """The loop over optimizer steps, one effective batch each, epoch by epoch (each its own order)."""
        p, cfg = self.progress, self.tcfg
        try:
            self.stop.__enter__()
            while p.step < self.total_steps and p.stopped is None:
                plan = epoch_batches(self.rows.lengths, self.effective, cfg.seed, p.epoch, cfg.group_by_length)
                while p.batches_done < len(plan) and p.step < self.total_steps:
                    t0 = time.perf_counter()
                    self.stop.step_starts()
                    try:
                        loss, real, padded = self.forward_backward(plan[p.batches_done])
                    except StepAbandoned:  # the step never happened: no gradients, the RNG as at its start
                        self.stop.rewind(self.optimizer)
                        self.stop_here()
                        continue  # the handler let the run go on: the step again
                    norm = grad_norm(self.model, self.accelerator, cfg.max_grad_norm)  # before clipping
                    self.watchdog.check(p, loss, norm)  # before the step: a diverged step never reaches the weights
                    skipped = self.optimizer_step()
                    self.watchdog.count_skip(p, skipped)
                    self.bookkeep(loss, real, padded, norm, time.perf_counter() - t0, len(plan))
                    epoch_end = p.batches_done == len(plan)
                    if epoch_end or (cfg.eval_every and p.step % cfg.eval_every == 0):
                        self.validate()
                    if epoch_end:
                        p.epoch, p.batches_done = p.epoch + 1, 0
                    if p.step % cfg.checkpoint_every == 0 or p.step == self.total_steps or p.stopped:
                        self.checkpoint()
                    if self.on_step is not None:
                        self.on_step(p.step, loss)
                    self.stop_here()
                    if epoch_end or p.stopped:
                        break  # the next epoch has its own order
            # ended mid-epoch, not on an evaluation: the last weights are validated too (decided alike on
            # every rank: validate() broadcasts across processes)
            if p.batches_done and p.stopped is None and not (cfg.eval_every and p.step % cfg.eval_every == 0):
                self.validate()
            self.stop_here()  # a signal during that validation
        finally:
            self.stop.__exit__()
            self.runlog.close()

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

    # ------------------------------------------------------------------ one step
    def forward_backward(self, idx: list[int]) -> tuple[float, int, int]:
        """Forward and backward of one effective batch: (its loss, real and padded tokens). A CUDA
        out-of-memory error halves the micro-batch (the effective batch stays) and runs it again."""
        p = self.progress
        while True:
            try:
                if self.world > 1:
                    return shard_window(self.model, self.rows, idx, p.micro_batch_size, self.pad_id, self.task,
                                        self.accelerator)
                micro = self.rows.batches(idx, p.micro_batch_size, self.pad_id, self.task)
                loss = accumulate_window(self.model, [mb.to(self.device) for mb in micro], self.task,
                                         self.accelerator, between=self.stop.check)
                return loss, sum(mb.real_tokens for mb in micro), sum(mb.padded_tokens for mb in micro)
            except RuntimeError as err:
                # across processes one rank cannot retry alone (the others wait in the all-reduce)
                if not is_oom(err) or p.micro_batch_size == 1 or self.world > 1:
                    raise
            old = p.micro_batch_size
            self.optimizer.zero_grad(set_to_none=True)
            release_memory()
            p.micro_batch_size = old // 2
            self.runlog.emit(logging.WARNING, "train: out of memory at step %d: micro-batch %d -> %d, accumulation "
                             "%d -> %d (effective batch %d unchanged); retrying the step", p.step + 1, old,
                             p.micro_batch_size, math.ceil(self.effective / old),
                             math.ceil(self.effective / p.micro_batch_size), self.effective)

    def optimizer_step(self) -> bool:
        """Step, schedule, clear the gradients. True when an fp16 grad scaler skipped the step (overflow)."""
        self.optimizer.step()
        skipped = self.accelerator.optimizer_step_was_skipped
        if not skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return skipped

    def bookkeep(self, loss: float, real: int, padded: int, norm: float, elapsed: float, batches: int) -> None:
        p = self.progress
        p.step += 1
        p.batches_done += 1
        p.real_tokens += real
        p.padded_tokens += padded
        p.train_seconds += elapsed
        if p.first_loss is None:  # kept in the checkpoint: a resumed run reports the run's first loss
            p.first_loss = loss
        self.last_loss = loss
        lr = self.scheduler.get_last_lr()[0]
        rec = {"kind": "train", "step": p.step, "epoch": p.epoch + 1, "loss": round(loss, 6), "lr": lr,
               "real_tokens": real, "padded_tokens": padded, "tokens_per_s": round(real / elapsed, 1),
               "micro_batch_size": p.micro_batch_size, "grad_norm": round(norm, 6)}
        if self.scaler is not None:
            rec["skipped_steps"] = p.skipped_steps
        self.runlog.train_step(rec, line=p.step % self.tcfg.log_every == 0 or p.step == self.total_steps,
                               batch=p.batches_done, batches=batches, total=self.total_steps,
                               tok_s=p.real_tokens / max(p.train_seconds, 1e-9),
                               padding=1 - p.real_tokens / max(p.padded_tokens, 1), skipped=p.skipped_steps)

    # ------------------------------------------------------------------ validation and checkpoints
    def validate(self) -> None:
        """Rank 0 validates (no grads: twice the micro-batch fits), may keep the weights as the best and
        decide to stop early; across processes that decision is broadcast to every rank."""
        p = self.progress
        if self.is_main and self.val_rows is not None:
            res = evaluate_loss(self.core, self.val_rows, self.task, self.pad_id, 2 * p.micro_batch_size, self.device,
                                getattr(self.tcfg.select_best, "metric", None), self.tokenizer)
            rec = {"kind": "validation", "step": p.step, "epoch": p.epoch + 1, **res}
            p.history.append(rec)
            note = self.keeper.update(p, res, self.core)
            self.runlog.validation(rec, note)
            if p.best is not None and p.best["step"] == p.step:
                self.runlog.write({"kind": "best", **p.best})
        if self.world > 1 and self.tcfg.early_stopping is not None:
            from accelerate.utils import broadcast

            flag = broadcast(torch.tensor([int(p.stopped is not None)], device=self.device), from_process=0)
            if int(flag.item()) and p.stopped is None:
                p.stopped = "early stopping (decided on rank 0)"

    def checkpoint(self) -> None:
        if self.is_main:
            best = self.keeper.path if self.progress.best is not None else None
            save_checkpoint(self.ckpt_dir, self.progress, self.core, self.optimizer, self.scheduler, self.scaler,
                            self.tcfg.keep_checkpoints, links={"best.safetensors": best} if best else None,
                            of=self.total_steps)
        self.saved_step = self.progress.step

    # ------------------------------------------------------------------ cleanup
    def finish(self, out_dir: Path) -> dict[str, Any]:
        p, cfg = self.progress, self.tcfg
        self.runlog.export(out_dir, metric_axis=cfg.eval_every is not None or cfg.select_best is not None)
        if self.is_main and p.best is not None:  # the artifact's weights are the best; the last ones beside them
            (out_dir / "last").mkdir(parents=True, exist_ok=True)
            save_file(trainable_state(self.core), str(out_dir / "last" / "trainable.safetensors"))
            self.keeper.load_best(self.core)
        self.accelerator.unwrap_model(self.model, keep_fp32_wrapper=False)
        self.accelerator.free_memory()
        health: dict[str, Any] = {"stopped": p.stopped or f"completed: {p.step} of {self.total_steps} steps"}
        if p.best is not None:
            health.update(best=p.best, last_step=p.step)
        if self.scaler is not None:
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
            "trainable_params": self.n_trainable,
            "total_params": self.n_total,
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


# ====================================================================== the loss of one effective batch

def shard_window(model: torch.nn.Module, rows: Rows, idx: list[int], micro_batch_size: int, pad_id: int,
                 task: str, accelerator: Any) -> tuple[float, int, int]:
    """This process's share of one *global* effective batch (N processes: batching.shard deals its rows
    out), forward and backward. The loss is divided by the count over the whole global effective batch
    (the per-process counts, all-reduced) and multiplied by N before backward, because DDP *averages*
    gradients over processes: the all-reduced gradient is then exactly that of the loss averaged over the
    global effective batch, as in one process. Returns the global loss, real and padded tokens."""
    world, device = accelerator.num_processes, accelerator.device
    mine = shard(idx, rows.lengths, accelerator.process_index, world)
    micro = [mb.to(device) for mb in rows.batches(mine, micro_batch_size, pad_id, task)] if mine else []
    units = torch.tensor([sum(loss_units(mb, task) for mb in micro)], dtype=torch.long, device=device)
    denominator = max(int(accelerator.reduce(units, reduction="sum").item()), 1)
    if micro:
        loss = accumulate_window(model, micro, task, accelerator, denominator=denominator, scale=float(world))
    else:  # a short last batch with fewer rows than processes: a zero-weight pass keeps DDP's all-reduce in step
        dummy = rows.batches(idx[:1], 1, pad_id, task)[0].to(device)
        accumulate_window(model, [dummy], task, accelerator, denominator=denominator, scale=0.0)
        loss = 0.0
    stats = torch.tensor([loss, sum(mb.real_tokens for mb in micro), sum(mb.padded_tokens for mb in micro)],
                         dtype=torch.float64, device=device)
    loss, real, padded = accelerator.reduce(stats, reduction="sum").tolist()
    return loss, int(real), int(padded)


# ====================================================================== several processes

def distributed_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def launch_training(task: str, tcfg: TrainConfig, upstream: dict[str, Path], out_dir: Path, work_dir: Path,
                    log: logging.Logger) -> dict[str, Any]:
    """train.num_processes > 1: run `train_worker` in that many processes (one per GPU; gloo processes on
    a CPU-only machine) under `accelerate launch`, owned and awaited by this stage. Rank 0 writes
    checkpoints into work_dir and the artifact into out_dir, which are passed down as they are."""
    n = tcfg.num_processes
    if torch.cuda.is_available() and torch.cuda.device_count() < n:
        raise ConfigError(f"train.num_processes: {n} processes need {n} GPUs, this machine has "
                          f"{torch.cuda.device_count()}; lower train.num_processes")
    args = {"task": task, "train": tcfg.model_dump(mode="json"), "upstream": {k: str(v) for k, v in upstream.items()},
            "out_dir": str(out_dir), "work_dir": str(work_dir)}
    return distributed.launch("stages.train:train_worker", args, n, work_dir / "launch", log,
                              port=tcfg.main_process_port, config_file=tcfg.accelerate_config, what="train",
                              num_machines=tcfg.num_machines, machine_rank=tcfg.machine_rank,
                              main_process_ip=tcfg.main_process_ip)


def train_worker(args: dict[str, Any]) -> dict[str, Any]:
    """One of the launched processes (stages.common.distributed runs it; rank 0's return value is the stage's)."""
    if torch.cuda.is_available():  # before loading: a quantized model goes to the current device (model.load_model)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return train_stage(args["task"], TrainConfig(**args["train"]), {k: Path(v) for k, v in args["upstream"].items()},
                       Path(args["out_dir"]), Path(args["work_dir"]), logging.getLogger("finetune.train"))
