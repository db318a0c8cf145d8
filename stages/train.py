"""Train stage: an explicit loop over a model made trainable by the adapters stage.

    setup  ->  loop over optimizer steps  ->  cleanup

Setup: precision (bf16 where supported, fp16 + grad scaler on older GPUs, fp32 on CPU), accelerate's
`Accelerator` (device placement, autocast, scaler, multi-GPU later without a rewrite), gradient
checkpointing, optimizer and LR schedule, and the latest resume checkpoint from `work_dir` if a run of
this same key was killed.

Loop: each optimizer step takes one *effective batch* (micro_batch_size x gradient_accumulation_steps
rows, chosen by a seeded length-grouped sampler: see stages/common/batching.py), cuts it into micro-batches
padded to their own longest row, and runs forward/backward on each. The loss is a *sum* divided by the
count over the whole effective batch (rows for classification, target tokens for LM tasks), so micro-batch
k x accumulation 1 and micro-batch 1 x accumulation k give the same gradients (transformers' Trainer
instead scales by the number of micro-batches). A CUDA out-of-memory error halves the micro-batch and
doubles accumulation (the same effective batch) and retries the step.

Cleanup: validation at each epoch end, metrics.jsonl + TensorBoard events + loss.png into the artifact,
the trained weights saved by `run` (PEFT adapter for LoRA, the whole model for `full`).

Several processes (train.num_processes > 1): `run` starts itself under `accelerate launch` (stages/
distributed.py), one process per GPU (gloo processes on CPU), and waits. Effective batch = micro-batch x
accumulation x processes; every process takes its shard of each effective batch (batching.shard), the loss
denominator is the count over the whole global batch, and DDP averages the gradients (shard_window), so the
weights equal one process's with accumulation x processes. Rank 0 alone validates, logs, checkpoints and
writes the artifact. The OOM back-off is off there (one process cannot retry alone).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from stages.common import distributed
from stages.common.batching import Batch, collate, epoch_batches, shard, split_micro
from stages.common.checkpoint import TrainingProgress, latest_checkpoint, load_checkpoint, save_checkpoint
from stages.common.losses import loss_units, summed_loss
from stages.common.models import load_trainable, save_trained
from stages.engine.errors import ConfigError, MissingInputError
from stages.engine.schema import TrainConfig

TASKS = ("seq_cls", "seq2seq", "causal_lm")


# ====================================================================== the loss

def accumulate_window(model: torch.nn.Module, micro_batches: list[Batch], task: str,
                      accelerator: Any = None, *, denominator: int | None = None, scale: float = 1.0) -> float:
    """Forward and backward every micro-batch of one effective batch. The gradients left in .grad are
    those of the loss averaged over the whole effective batch. Returns that loss.
    Across processes (see shard_window) `denominator` is the count over the whole *global* effective
    batch and `scale` multiplies what is backpropagated (not the loss returned)."""
    if denominator is None:
        denominator = max(sum(loss_units(mb, task) for mb in micro_batches), 1)
    total = None  # kept on the device: reading it once per step, not per micro-batch, keeps a GPU busy
    for k, mb in enumerate(micro_batches):
        is_accumulating = k < len(micro_batches) - 1
        # across GPUs, gradients are only synchronised on the last micro-batch
        sync = accelerator.no_sync(model) if (accelerator is not None and is_accumulating) \
            else contextlib.nullcontext()
        with sync:
            loss = summed_loss(model, mb, task) / denominator
            scaled = loss * scale if scale != 1.0 else loss
            if accelerator is not None:
                accelerator.backward(scaled)
            else:
                scaled.backward()
        total = loss.detach().float() if total is None else total + loss.detach().float()
    return float(total) if total is not None else 0.0


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


# ====================================================================== setup helpers

def resolve_precision(setting: str, device: torch.device) -> str:
    """auto: bf16 on GPUs that have it, fp16 (+ grad scaler) on older GPUs, fp32 ("no") on CPU
    (bf16 matmuls are ~80x slower on these CPUs)."""
    if setting == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "no"
    if setting == "fp16" and device.type != "cuda":
        raise ConfigError("train.mixed_precision: fp16 needs a CUDA GPU; use auto (fp32 on CPU) or bf16")
    return setting


def make_accelerator(mixed_precision: str, log: logging.Logger) -> tuple[Any, str]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve_precision(mixed_precision, device)
    AcceleratorState._reset_state(True)  # several trainings in one process (tests, bench) may differ
    # accumulation is ours (token-normalised), so accelerate's own is left at 1
    accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=1, cpu=device.type == "cpu")
    log.info("train: device %s, mixed precision %s (setting %s)", accelerator.device, precision, mixed_precision)
    return accelerator, precision


def make_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float, device: torch.device,
                   log: logging.Logger) -> torch.optim.Optimizer:
    """adam (the BLOOM article's) | adamw_torch | adamw_8bit | paged_adamw_8bit (bitsandbytes). Weight
    decay applies to matrices only, not to biases and norm weights (nanoGPT)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise MissingInputError("train: the model has no trainable parameters; check the adapters stage "
                                "(adapters.method, adapters.target_modules)")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if name == "adamw_torch":
        return torch.optim.AdamW(groups, lr=lr)
    import bitsandbytes as bnb

    if name == "paged_adamw_8bit":
        if device.type == "cuda":
            return bnb.optim.PagedAdamW8bit(groups, lr=lr)
        log.warning("train.optimizer paged_adamw_8bit: paging needs CUDA; on %s using non-paged adamw_8bit "
                    "(same update rule)", device.type)
    return bnb.optim.AdamW8bit(groups, lr=lr)


def lr_factor(step: int, schedule: str, warmup: int, total: int) -> float:
    """Multiplier of the base LR at optimizer step `step`: linear warmup, then constant/linear/cosine."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    frac = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - frac)
    return 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))  # cosine


def make_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup: int, total: int) -> Any:
    def factor(step: int) -> float:  # a plain function: the scheduler's state_dict stays tensors/numbers
        return lr_factor(step, schedule, warmup, total)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def enable_gradient_checkpointing(model: torch.nn.Module, log: logging.Logger) -> None:
    """The one place that turns gradient checkpointing on (non-reentrant: frozen inputs need no
    enable_input_require_grads), except for k-bit models, where models.load_trainable's
    prepare_model_for_kbit_training already did. Either way the KV cache goes off (useless in training)."""
    flag = "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else "is_gradient_checkpointing"
    if not getattr(model, flag, False):
        # transformers 5 renamed gradient_checkpointing_enable to activation_checkpointing_enable
        if (enable := getattr(model, "activation_checkpointing_enable", None)) is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif (enable := getattr(model, "gradient_checkpointing_enable", None)) is not None:
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            log.warning("train.gradient_checkpointing: %s does not support it; ignored", type(model).__name__)
            return
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False


def upcast_trainable(model: torch.nn.Module, log: logging.Logger) -> None:
    """Mixed precision keeps fp32 master weights: half-precision trainable weights would break the grad
    scaler and lose small updates."""
    n = 0
    for p in model.parameters():
        if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()
            n += 1
    if n:
        log.info("train: %d trainable tensors upcast to fp32 (master weights)", n)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


# ====================================================================== data

class Rows:
    """Row access to a tokenized split (a datasets.Dataset or a list of dicts, for tests)."""

    def __init__(self, ds: Any):
        self.ds = ds
        if isinstance(ds, list):
            self.lengths = [len(r["input_ids"]) for r in ds]
        else:
            cols = ds.column_names
            self.lengths = list(ds["length"]) if "length" in cols else [len(x) for x in ds["input_ids"]]

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, idx: list[int]) -> list[dict]:
        if isinstance(self.ds, list):
            return [self.ds[i] for i in idx]
        cols = self.ds[idx]
        return [{"input_ids": cols["input_ids"][j], "labels": cols["labels"][j]} for j in range(len(idx))]

    def batches(self, idx: list[int], micro: int, pad_id: int, task: str) -> list[Batch]:
        return [collate(self.get(mb), pad_id, task) for mb in split_micro(idx, self.lengths, micro)]


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, rows: Rows, task: str, pad_id: int, batch_size: int,
                  device: torch.device) -> dict[str, float]:
    """Validation: mean loss (per row or per target token) and, for classification, accuracy."""
    was_training = model.training
    model.eval()
    loss_sum, units, correct = 0.0, 0, 0
    order = sorted(range(len(rows)), key=lambda i: rows.lengths[i])
    for i in range(0, len(order), batch_size):
        b = collate(rows.get(order[i:i + batch_size]), pad_id, task).to(device)
        if task == "seq_cls":
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()
            loss_sum += float(F.cross_entropy(logits, b.labels, reduction="sum"))
            correct += int((logits.argmax(-1) == b.labels).sum())
        else:
            loss_sum += float(summed_loss(model, b, task))
        units += loss_units(b, task)
    model.train(was_training)
    out = {"val_loss": round(loss_sum / max(units, 1), 6)}
    if task == "seq_cls":
        out["val_accuracy"] = round(correct / max(len(rows), 1), 6)
    return out


# ====================================================================== visibility

class RunLog:
    """metrics.jsonl + TensorBoard events, kept in work_dir while training (so a resumed run continues
    them) and copied into the artifact at the end."""

    def __init__(self, folder: Path, resume_step: int):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "metrics.jsonl"
        if self.path.exists():  # drop what a killed run logged after its last checkpoint
            keep = [ln for ln in self.path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in keep))
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(folder / "tensorboard"), purge_step=resume_step or None)
        except ImportError:  # tensorboard is optional at runtime
            pass

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float):
                    self.tb.add_scalar(f"{record.get('kind', 'train')}/{k}", v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()

    def export(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.path, out_dir / "metrics.jsonl")
        if (self.folder / "tensorboard").is_dir():
            shutil.copytree(self.folder / "tensorboard", out_dir / "tensorboard", dirs_exist_ok=True)
        plot_loss(self.path, out_dir / "loss.png")


class NoRunLog:
    """What processes other than rank 0 log: nothing (rank 0 writes metrics for the whole batch)."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass

    def export(self, out_dir: Path) -> None:
        pass


def plot_loss(metrics_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    train = [r for r in recs if r.get("kind") == "train"]
    val = [r for r in recs if r.get("kind") == "validation"]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, metadata={"Software": None})  # no version/date stamp: same curve, same bytes
    plt.close(fig)


# ====================================================================== the loop

def train_model(model: torch.nn.Module, train_ds: Any, val_ds: Any, tcfg: Any, task: str, pad_id: int,
                out_dir: Path, work_dir: Path, log: logging.Logger, *, on_step: Any = None) -> dict[str, Any]:
    """Train `model` in place on the tokenized `train_ds`; write metrics.jsonl, tensorboard/ and loss.png
    to out_dir; resume from (and checkpoint to) work_dir/checkpoints. Returns the manifest metrics.
    `on_step(step, loss)` is a test hook called after every optimizer step.
    Under `accelerate launch` (N processes) each process trains on its shard of every effective batch
    (shard_window); only rank 0 validates, logs and writes checkpoints and out_dir."""
    if task not in TASKS:
        raise ConfigError(f"model.task: {task!r} is not one of {TASKS}")
    if pad_id is None:
        raise MissingInputError("train: the tokenizer has no pad token; the tokenize stage should set one")

    # ---------------------------------------------------------------- setup
    accelerator, precision = make_accelerator(tcfg.mixed_precision, log)
    device = accelerator.device
    world, is_main = accelerator.num_processes, accelerator.is_main_process
    if precision != "no":
        upcast_trainable(model, log)
    if tcfg.gradient_checkpointing:
        enable_gradient_checkpointing(model, log)
    rows = Rows(train_ds)
    if not len(rows):
        raise MissingInputError("train: the train split is empty; check data.subset / data.split")
    val_rows = Rows(val_ds) if val_ds is not None and len(val_ds) else None
    effective = tcfg.micro_batch_size * tcfg.gradient_accumulation_steps * world
    steps_per_epoch = math.ceil(len(rows) / effective)
    total_steps = tcfg.max_steps or math.ceil(tcfg.epochs * steps_per_epoch)
    optimizer = make_optimizer(model, tcfg.optimizer, tcfg.lr, tcfg.weight_decay, device, log)
    scheduler = make_scheduler(optimizer, tcfg.lr_scheduler, tcfg.warmup_steps, total_steps)
    seed_everything(tcfg.seed)
    model.train()
    model, optimizer = accelerator.prepare(model, optimizer)
    scaler = accelerator.scaler  # None unless fp16
    core = accelerator.unwrap_model(model)  # DDP's module (the model itself in one process): checkpoints, validation

    progress = TrainingProgress(micro_batch_size=tcfg.micro_batch_size)
    ckpt_dir = work_dir / "checkpoints"
    resumed_from = None
    if (ckpt := latest_checkpoint(ckpt_dir)) is not None:
        progress = load_checkpoint(ckpt, core, optimizer, scheduler, scaler)
        resumed_from = progress.step
        log.info("train: resumed from step %d (epoch %d, batch %d of the epoch) - checkpoint %s",
                 progress.step, progress.epoch + 1, progress.batches_done, ckpt.name)
    runlog = RunLog(work_dir / "logs", progress.step) if is_main else NoRunLog()
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_total = sum(p.numel() for p in model.parameters())
    log.info("train: %d examples, effective batch %d = micro-batch %d x accumulation %d%s, %d steps/epoch, "
             "%d steps; %s lr %.2g; %d trainable of %d params (%.2f%%)", len(rows), effective,
             tcfg.micro_batch_size, tcfg.gradient_accumulation_steps,
             f" x {world} processes" if world > 1 else "", steps_per_epoch, total_steps,
             tcfg.optimizer, tcfg.lr, n_trainable, n_total, 100 * n_trainable / max(n_total, 1))

    def checkpoint() -> None:
        if is_main:
            save_checkpoint(ckpt_dir, progress, core, optimizer, scheduler, scaler, tcfg.keep_checkpoints)

    def validate() -> None:
        if val_rows is None or not is_main:
            return
        res = evaluate_loss(core, val_rows, task, pad_id, 2 * progress.micro_batch_size, device)  # no grads: room
        rec = {"kind": "validation", "step": progress.step, "epoch": progress.epoch + 1, **res}
        progress.history.append(rec)
        runlog.write(rec)
        log.info("Epoch: %03d | validation %s", progress.epoch + 1,
                 " | ".join(f"{k} {v:.4f}" for k, v in res.items()))

    # ---------------------------------------------------------------- loop
    bar = tqdm(total=total_steps, initial=progress.step, desc="train", unit="step", disable=None if is_main else True)
    last_loss = None
    while progress.step < total_steps:
        epoch_plan = epoch_batches(rows.lengths, effective, tcfg.seed, progress.epoch, tcfg.group_by_length)
        while progress.batches_done < len(epoch_plan) and progress.step < total_steps:
            idx = epoch_plan[progress.batches_done]
            t0 = time.perf_counter()
            while True:  # one optimizer step; retried with half the micro-batch on OOM
                try:
                    if world == 1:
                        micro = rows.batches(idx, progress.micro_batch_size, pad_id, task)
                        loss = accumulate_window(model, [mb.to(device) for mb in micro], task, accelerator)
                        real = sum(mb.real_tokens for mb in micro)
                        padded = sum(mb.padded_tokens for mb in micro)
                    else:
                        loss, real, padded = shard_window(model, rows, idx, progress.micro_batch_size, pad_id,
                                                          task, accelerator)
                    break
                except RuntimeError as err:
                    # across processes one rank cannot retry alone (the others wait in the all-reduce)
                    if not is_oom(err) or progress.micro_batch_size == 1 or world > 1:
                        raise
                    old = progress.micro_batch_size
                optimizer.zero_grad(set_to_none=True)
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                progress.micro_batch_size = old // 2
                log.warning("train: out of memory at step %d: micro-batch %d -> %d, accumulation %d -> %d "
                            "(effective batch %d unchanged); retrying the step", progress.step + 1, old,
                            progress.micro_batch_size, math.ceil(effective / old),
                            math.ceil(effective / progress.micro_batch_size), effective)
            grad_norm = None
            if tcfg.max_grad_norm:
                grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), tcfg.max_grad_norm))
            optimizer.step()
            if not accelerator.optimizer_step_was_skipped:  # fp16 overflow: the scaler skipped the step
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - t0

            progress.step += 1
            progress.batches_done += 1
            progress.real_tokens += real
            progress.padded_tokens += padded
            progress.train_seconds += elapsed
            if progress.first_loss is None:  # kept in the checkpoint: a resumed run reports the run's first loss
                progress.first_loss = loss
            last_loss = loss
            lr = scheduler.get_last_lr()[0]
            tok_s = progress.real_tokens / max(progress.train_seconds, 1e-9)
            rec = {"kind": "train", "step": progress.step, "epoch": progress.epoch + 1, "loss": round(loss, 6),
                   "lr": lr, "real_tokens": real, "padded_tokens": padded, "tokens_per_s": round(real / elapsed, 1),
                   "micro_batch_size": progress.micro_batch_size}
            if grad_norm is not None:
                rec["grad_norm"] = round(grad_norm, 6)
            runlog.write(rec)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:.0f}")
            bar.update(1)
            if progress.step % tcfg.log_every == 0 or progress.step == total_steps:
                log.info("Epoch: %03d | Batch %04d/%04d | Step %04d/%04d | Loss: %.4f | lr %.2e | %.0f tok/s | "
                         "padding %.1f%%", progress.epoch + 1, progress.batches_done, len(epoch_plan),
                         progress.step, total_steps, loss, lr, tok_s,
                         100 * (1 - progress.real_tokens / max(progress.padded_tokens, 1)))
            epoch_end = progress.batches_done == len(epoch_plan)
            if epoch_end:
                validate()
                progress.epoch += 1
                progress.batches_done = 0
            if progress.step % tcfg.checkpoint_every == 0 or progress.step == total_steps:
                checkpoint()
            if on_step is not None:
                on_step(progress.step, loss)
            if epoch_end:
                break  # the next epoch has its own order
    bar.close()
    if progress.batches_done:  # stopped mid-epoch (epoch ends validated in the loop and reset batches_done)
        validate()  # a fractional last epoch still gets a validation

    # ---------------------------------------------------------------- cleanup
    runlog.close()
    runlog.export(out_dir)
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    accelerator.free_memory()
    computed = max(progress.padded_tokens, 1)
    return {
        "steps": progress.step,
        "epochs_done": round(progress.epoch + progress.batches_done / max(steps_per_epoch, 1), 4),
        "examples": len(rows),
        "effective_batch": effective,  # micro_batch_size x gradient_accumulation_steps x num_processes
        "micro_batch_size": progress.micro_batch_size,
        "gradient_accumulation_steps": math.ceil(effective / (progress.micro_batch_size * world)),
        "num_processes": world,
        "precision": precision,
        "optimizer": tcfg.optimizer,
        "trainable_params": n_trainable,
        "total_params": n_total,
        "real_tokens": progress.real_tokens,
        "padded_tokens": progress.padded_tokens,
        "padding_share": round(1 - progress.real_tokens / computed, 4),
        "tokens_per_s": round(progress.real_tokens / max(progress.train_seconds, 1e-9), 1),
        "train_seconds": round(progress.train_seconds, 3),
        "first_loss": progress.first_loss,
        "final_loss": last_loss,
        "validation": progress.history,
        "resumed_from_step": resumed_from,
    }


# ====================================================================== the stage

def run(ctx: Any) -> dict[str, Any]:
    task, tcfg = ctx.cfg.model.task, ctx.cfg.train
    if tcfg.num_processes > 1:  # the same body, once per process, under `accelerate launch`
        return launch_training(task, tcfg, ctx.upstream, ctx.out_dir, ctx.work_dir, ctx.log)
    return train_stage(task, tcfg, ctx.upstream, ctx.out_dir, ctx.work_dir, ctx.log)


def train_stage(task: str, tcfg: Any, upstream: dict[str, Path], out_dir: Path, work_dir: Path,
                log: logging.Logger) -> dict[str, Any]:
    import datasets
    from transformers import AutoTokenizer

    tok_dir = upstream["tokenize"]
    ds = datasets.load_from_disk(str(tok_dir / "dataset"))
    pad_id = AutoTokenizer.from_pretrained(str(tok_dir / "tokenizer")).pad_token_id
    model = load_trainable(upstream["model"], upstream["adapters"],
                                    gradient_checkpointing=tcfg.gradient_checkpointing)
    metrics = train_model(model, ds["train"], ds["validation"] if "validation" in ds else None, tcfg, task,
                          pad_id, out_dir, work_dir, log)
    if distributed_rank() == 0:  # only rank 0 writes the artifact (0 without a process group)
        save_trained(model, out_dir / "trained", upstream["model"])
    return metrics


def distributed_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def launch_training(task: str, tcfg: Any, upstream: dict[str, Path], out_dir: Path, work_dir: Path,
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
                              port=tcfg.main_process_port, config_file=tcfg.accelerate_config, what="train")


def train_worker(args: dict[str, Any]) -> dict[str, Any]:
    """One of the launched processes (stages.common.distributed runs it; rank 0's return value is the stage's)."""
    if torch.cuda.is_available():  # before loading: a quantized model goes to the current device (model.load_model)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return train_stage(args["task"], TrainConfig(**args["train"]), {k: Path(v) for k, v in args["upstream"].items()},
                       Path(args["out_dir"]), Path(args["work_dir"]), logging.getLogger("finetune.train"))

