"""Resume checkpoints for the train stage, written under the stage's work_dir (which survives a crash).

One checkpoint is a folder `step-000050/` holding
  trainable.safetensors   the trainable weights (LoRA + modules_to_save, or every weight for `full`)
  state.pt                optimizer, scheduler, grad scaler and RNG states: tensors and plain python
                          containers only, so `torch.load(weights_only=True)` reads it (no pickled objects)
  progress.json           the TrainingProgress record (step, epoch, data position, micro-batch...)
  best.safetensors        with train.select_best: the best evaluation's trainable weights so far (a hard
                          link to the one file stages/training/health.py keeps, not a second copy)
It is written as `.tmp-*` and renamed into place (progress.json last, then the rename), so a kill at
any moment leaves either the whole checkpoint or none; only the last `keep` are kept. On a shared store
(s3://...) each checkpoint is also uploaded as it is written, replacing the previous one there, so a run
of the same key on another machine resumes from it (stages/engine/store.py, Store.publish_work); in a
process launched for num_processes / num_machines > 1 (rank 0 alone saves) the stage's own process uploads
it while rank 0 waits (stages/training/distributed.py, hand_over).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from stages.engine.status import RESUME_FILE
from stages.engine.store import fsync_path, work_saved

CKPT_RE = re.compile(r"^step-(\d{6,})$")


@dataclass
class TrainingProgress:
    """Everything the loop needs to carry on where it stopped (torchtune's TrainingProgress)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch (0-based)
    batches_done: int = 0  # effective batches of `epoch` already consumed (the data position)
    micro_batch_size: int = 1  # may be smaller than configured after an OOM back-off
    real_tokens: int = 0
    padded_tokens: int = 0
    train_seconds: float = 0.0
    first_loss: float | None = None  # the run's first step loss (absent from older checkpoints: None)
    history: list[dict[str, Any]] = field(default_factory=list)  # validation results, in order
    # training health (stages/training/health.py); absent from older checkpoints: the defaults
    best: dict[str, Any] | None = None  # {metric, mode, step, value} of the best evaluation so far
    evals_since_best: int = 0  # evaluations without an improvement above early_stopping.min_delta
    stopped: str | None = None  # why training ended before its planned steps (early stopping)
    skipped_steps: int = 0  # optimizer steps an fp16 grad scaler skipped (gradient overflow)
    skipped_in_a_row: int = 0
    recent_losses: list[float] = field(default_factory=list)  # the divergence check's window of losses
    recent_means: list[float] = field(default_factory=list)  # ... and its history of windowed means


# ---------------------------------------------------------------- RNG states, weights_only-loadable

def rng_state() -> dict[str, Any]:
    np_state: tuple[Any, ...] = np.random.get_state()  # type: ignore[assignment]  # the legacy tuple
    py_state = random.getstate()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        "python": {"version": py_state[0], "state": list(py_state[1]), "gauss": py_state[2]},
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- weights

def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train (named as in model.named_parameters()), detached on CPU."""
    return {n: p.detach().to("cpu").contiguous().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in state]
    if missing:
        raise ValueError(f"checkpoint lacks trainable weights {missing[:3]}... (model changed since it was written)")
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t.to(params[n].device, params[n].dtype))


# ---------------------------------------------------------------- folders

def checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = CKPT_RE.match(p.name)
        if m and (p / "progress.json").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def save_checkpoint(root: Path, progress: TrainingProgress, model: torch.nn.Module, optimizer: Any,
                    scheduler: Any, scaler: Any, keep: int, links: dict[str, Path] | None = None,
                    of: int | None = None) -> Path:
    """`links`: files to hold in the checkpoint under these names, hard-linked (copied where links fail).
    `of`: the run's planned steps, for `inspect status` ("resumable from step N of M": write_resume_point)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # a dead writer's leftovers
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    for name, src in (links or {}).items():
        link_or_copy(src, tmp / name)
    save_file(trainable_state(model), str(tmp / "trainable.safetensors"))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None, "rng": rng_state()},
               tmp / "state.pt")
    (tmp / "progress.json").write_text(json.dumps(asdict(progress), indent=1))
    for f in tmp.iterdir():
        fsync_path(f)
    fsync_path(tmp)
    final = root / f"step-{progress.step:06d}"
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(root)
    for _, old in checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    if of is not None:
        write_resume_point(root.parent, progress.step, of)
    work_saved(final)  # on a shared store: uploaded now, the newest one only, so another machine resumes
    return final


def link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (the same bytes held twice without a second copy), a copy where links fail."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                    scaler: Any) -> TrainingProgress:
    load_trainable_state(model, load_file(str(path / "trainable.safetensors")))
    state = torch.load(path / "state.pt", weights_only=True, map_location="cpu")
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    return TrainingProgress(**json.loads((path / "progress.json").read_text()))


def write_resume_point(work_dir: Path, step: int, total: int) -> None:
    """For `inspect status`: "resumable from step N of M" (stages/engine/status.py reads it)."""
    tmp = work_dir / f".{RESUME_FILE}.tmp"
    tmp.write_text(json.dumps({"step": step, "of": total}))
    os.replace(tmp, work_dir / RESUME_FILE)


def latest_checkpoint(root: Path) -> Path | None:
    found = checkpoints(root)
    return found[-1][1] if found else None
