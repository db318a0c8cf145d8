"""Progress of long loops: a bar in a terminal, log lines every N% elsewhere, a summary line either way."""

from __future__ import annotations

import contextlib
import logging
import os
import pty
import subprocess
import sys

from helpers import ROOT

from stages.engine.progress import Progress, iterate


def run_steps(n: int, log: logging.Logger) -> None:
    bar = Progress(n, "train", log, unit="step")
    for step in range(1, n + 1):
        bar.set_postfix(loss=f"{1 / step:.4f}", tok_s="100")
        bar.update(1)
    bar.close()


def test_without_a_terminal_progress_is_a_log_line_every_n_percent(caplog, monkeypatch):
    monkeypatch.setenv("FINETUNE_PROGRESS", "log")
    monkeypatch.setenv("FINETUNE_PROGRESS_PERCENT", "25")
    log = logging.getLogger("finetune.test")
    with caplog.at_level(logging.INFO, logger="finetune"):
        run_steps(8, log)
    lines = [r.getMessage() for r in caplog.records if r.name == "finetune.test"]
    assert [ln.split(" | ")[0] for ln in lines] == ["train:  25% (2/8 steps)", "train:  50% (4/8 steps)",
                                                    "train:  75% (6/8 steps)", "train: 100% (8/8 steps)",
                                                    "train: done, 8/8 steps in 0:00:00"]
    assert lines[1].split(" | ")[1:3] == ["loss 0.2500", "tok/s 100"] and "| ETA 0:00:00" in lines[1]


def test_a_resumed_run_counts_from_its_step_and_short_loops_stay_silent(caplog, monkeypatch):
    monkeypatch.setenv("FINETUNE_PROGRESS", "log")
    log = logging.getLogger("finetune.test")
    with caplog.at_level(logging.INFO, logger="finetune"):
        bar = Progress(10, "train", log, initial=6)
        for _ in range(4):
            bar.update(1)
        bar.close()
        assert list(iterate(range(3), "evaluate test", log)) == [0, 1, 2]  # under 2 s: no line
    lines = [r.getMessage().split(" | ")[0] for r in caplog.records]
    assert lines == ["train:  70% (7/10 steps)", "train:  80% (8/10 steps)", "train:  90% (9/10 steps)",
                     "train: 100% (10/10 steps)", "train: done, 10/10 steps in 0:00:00"]


def test_in_a_terminal_a_bar_with_the_figures_and_log_lines_above_it(capsys, caplog, monkeypatch):
    monkeypatch.setenv("FINETUNE_PROGRESS", "bar")
    log = logging.getLogger("finetune.test")
    with caplog.at_level(logging.INFO, logger="finetune"):
        run_steps(3, log)
    err = capsys.readouterr().err
    assert "train: 100%" in err and "3/3" in err and "loss=0.3333" in err and "tok_s=100" in err
    assert [r.getMessage() for r in caplog.records] == ["train: done, 3/3 steps in 0:00:00 | loss 0.3333 | tok/s 100"]


STEPS = """
import logging, sys
from stages.engine.progress import Progress
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
bar = Progress(20, "train", logging.getLogger("finetune.train"), unit="step")
for step in range(20):
    bar.set_postfix(loss=f"{1 / (step + 1):.4f}")
    bar.update(1)
bar.close()
"""


def steps_written_to(stderr: int | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FINETUNE_PROGRESS")}  # the default mode
    return subprocess.run([sys.executable, "-c", STEPS], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          stderr=stderr, stdout=subprocess.DEVNULL, timeout=60)


def test_a_log_that_is_not_a_terminal_gets_lines_never_carriage_returns(tmp_path):
    """The mode follows the real stream: stderr a file (CI, `2>&1 | tee`, a worker's log) -> plain lines every
    10%, no `\\r` redraws; stderr a terminal (a pty) -> the bar, redrawn with `\\r`."""
    log = tmp_path / "train.log"
    with log.open("w") as fh:
        assert steps_written_to(fh.fileno()).returncode == 0
    text = log.read_text()
    assert "\r" not in text
    assert [ln.split(" | ")[0] for ln in text.splitlines()] == [
        *(f"train: {p:3d}% ({p // 5}/20 steps)" for p in range(10, 101, 10)), "train: done, 20/20 steps in 0:00:00"]

    main, child = pty.openpty()
    try:
        assert steps_written_to(child).returncode == 0
        os.close(child)
        child = -1
        out = b""
        with contextlib.suppress(OSError):  # EIO once everything written is read
            while chunk := os.read(main, 65536):
                out += chunk
    finally:
        os.close(main)
        if child >= 0:
            os.close(child)
    assert b"\r" in out and b"20/20" in out
