"""What a training run shows and leaves behind: the log lines and progress bar, metrics.jsonl, TensorBoard
events and loss.png. Every line the train loop emits goes through `RunLog.emit`, so how lines and the bar
reach people (the terminal, an orchestrator's log) is decided in this one place."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from stages.engine.progress import Progress
from stages.engine.runs import read_metrics
from stages.pipeline.tracking import RECORDS_LOGGER

# Each record written also goes to this logger, for a listener the run attaches (experiment tracking,
# stages/pipeline/tracking.py): through logging, so that no tracking code is part of the train stage's code
# (nor of its key). Not propagated: a record is data, not a line for people.
RECORDS = logging.getLogger(RECORDS_LOGGER)
RECORDS.propagate = False


class RunLog:
    """metrics.jsonl + TensorBoard events, kept in work_dir while training (so a resumed run continues
    them) and copied into the artifact at the end; the progress bar and the log lines."""

    def __init__(self, folder: Path, resume_step: int, log: logging.Logger, total_steps: int):
        self.folder, self.log = folder, log
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "metrics.jsonl"
        if self.path.exists():  # drop what a killed run logged after its last checkpoint
            keep = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(folder / "tensorboard"), purge_step=resume_step or None)
        except ImportError:  # tensorboard is optional at runtime
            pass
        # a bar in a terminal, else a log line every N% (stages/engine/progress.py); a summary line at close
        self.bar = Progress(total_steps, "train", log, initial=resume_step, unit="step")

    def emit(self, level: int, msg: str, *args: Any) -> None:
        """The one way a line of the run reaches people."""
        self.log.log(level, msg, *args)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if RECORDS.handlers:
            RECORDS.info("%s", record.get("kind"), extra={"record": record})
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float):
                    self.tb.add_scalar(f"{record.get('kind', 'train')}/{k}", v, record["step"])

    def train_step(self, rec: dict[str, Any], *, line: bool, batch: int, batches: int, total: int, tok_s: float,
                   padding: float, skipped: int) -> None:
        """One optimizer step: its record, the bar, and every `log_every` steps the log line."""
        self.write(rec)
        self.bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", tok_s=f"{tok_s:.0f}")
        self.bar.update(1)
        if line:
            self.emit(logging.INFO, "Epoch: %03d | Batch %04d/%04d | Step %04d/%04d | Loss: %.4f | lr %.2e | "
                      "grad norm %.4g | %.0f tok/s | padding %.1f%%%s", rec["epoch"], batch, batches, rec["step"],
                      total, rec["loss"], rec["lr"], rec["grad_norm"], tok_s, 100 * padding,
                      f" | {skipped} steps skipped by the fp16 grad scaler" if skipped else "")

    def validation(self, rec: dict[str, Any], note: str = "") -> None:
        self.write(rec)
        shown = " | ".join(f"{k} {v:.4f}" for k, v in rec.items() if k.startswith("val_"))
        self.emit(logging.INFO, "Epoch: %03d | Step %04d | validation %s%s", rec["epoch"], rec["step"], shown, note)

    def close(self) -> None:
        self.bar.close()
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    def export(self, out_dir: Path, metric_axis: bool = False) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.path, out_dir / "metrics.jsonl")
        if (self.folder / "tensorboard").is_dir():
            shutil.copytree(self.folder / "tensorboard", out_dir / "tensorboard", dirs_exist_ok=True)
        plot_loss(self.path, out_dir / "loss.png", metric_axis)


class NoRunLog:
    """What processes other than rank 0 log: nothing (rank 0 writes metrics for the whole batch)."""

    def __init__(self, log: logging.Logger):
        self.log = log

    def emit(self, level: int, msg: str, *args: Any) -> None:
        if level >= logging.WARNING:  # every process may have something to warn about
            self.log.log(level, msg, *args)

    def write(self, record: dict[str, Any]) -> None:
        pass

    def train_step(self, rec: dict[str, Any], **kw: Any) -> None:
        pass

    def validation(self, rec: dict[str, Any], note: str = "") -> None:
        pass

    def close(self) -> None:
        pass

    def export(self, out_dir: Path, metric_axis: bool = False) -> None:
        pass


def plot_loss(metrics_path: Path, png: Path, metric_axis: bool = False) -> None:
    """Train loss per step, validation loss at each evaluation; with `metric_axis` (evaluation during
    training or best-checkpoint selection on) also validation accuracy on a right axis and the selected
    best step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    train = [r for r in recs if r.get("kind") == "train"]
    val = [r for r in recs if r.get("kind") == "validation"]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    handles, labels = ax.get_legend_handles_labels()
    if metric_axis and any("val_accuracy" in r for r in val):
        acc = [r for r in val if "val_accuracy" in r]
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in acc], [r["val_accuracy"] for r in acc], "s--", color="tab:green",
                 label="validation accuracy")
        ax2.set_ylabel("accuracy")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    best = [r for r in recs if r.get("kind") == "best"]
    if metric_axis and best:
        line = ax.axvline(best[-1]["step"], color="tab:red", ls=":", lw=1,
                          label=f"best step {best[-1]['step']} ({best[-1]['metric']})")
        handles, labels = handles + [line], labels + [line.get_label()]
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    if len(handles) > len(ax.get_legend_handles_labels()[0]):
        ax.legend(handles, labels)
    else:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, metadata={"Software": None})  # no version/date stamp: same curve, same bytes
    plt.close(fig)
