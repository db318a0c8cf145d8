"""Command-line pieces shared by `python -m stages` (no Prefect) and the flows' entry points: the
arguments, loading them into a config, one line per outcome, and errors as one line with exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stages.engine.config import DEFAULT_PIPELINE_FILE
from stages.engine.errors import FinetuneError
from stages.engine.hooks import Hook
from stages.engine.stage import JOINED

if TYPE_CHECKING:  # `finetune predict` on an export folder imports no store
    from stages.engine.hooks import Run
    from stages.engine.store import Outcome


def parser(prog: str, default_pipeline: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run a named pipeline of pipeline.yaml through the "
                                "store, keyed by each stage's inputs; stages whose inputs did not change are reused.")
    if default_pipeline:
        p.add_argument("pipeline", nargs="?", default=default_pipeline, help=f"default: {default_pipeline}")
    else:
        p.add_argument("pipeline", help="a pipeline name from pipeline.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.lr=1e-4 (repeatable)")
    p.add_argument("--only", metavar="STAGE", help="run only this stage, reading its upstream from the store")
    p.add_argument("--until", metavar="STAGE", help="stop after this stage")
    p.add_argument("--force", action="append", default=[], metavar="STAGE", help="recompute this stage")
    p.add_argument("--verify", action="store_true", help="check full sha256 of cached artifacts, not just sizes")
    add_track_option(p)
    add_config_option(p)
    return p


def add_track_option(p: argparse.ArgumentParser) -> None:
    """`--track`: log the run to MLflow (tracking.mlflow.uri or MLFLOW_TRACKING_URI; docs/tracking.md)."""
    p.add_argument("--track", action="store_true", help="log the run to MLflow at tracking.mlflow.uri or "
                   "MLFLOW_TRACKING_URI (pip install '.[mlflow]'; docs/tracking.md)")


def add_config_option(p: argparse.ArgumentParser) -> None:
    """`--config FILE`, the same on every entry point: the pipeline file (default the project's
    pipeline.yaml; any other file builds on it, see stages/engine/config.py)."""
    p.add_argument("--config", type=Path, default=DEFAULT_PIPELINE_FILE, metavar="FILE",
                   help="pipeline file (default: the project's pipeline.yaml, which another file extends)")


def describe(o: Outcome) -> str:
    """One line per stage outcome. A cached stage took no time now: its column says so, and its original
    compute time is named apart."""
    secs = o.manifest.get("duration_s") or 0.0
    if o.computed or o.reason == JOINED:
        status, took, note = "computed" if o.computed else JOINED, f"{secs:>8.1f}s", ""
    else:
        status, took, note = "cached", f"{'-':>9}", f"  (computed earlier in {secs:.1f}s)"
    return f"  {o.stage:<10} {status:<8} {took}  {o.key[:12]}  {o.path}{note}"


class Lines(Hook):
    """A run on a console: a line per finished stage (`describe`) and, when it ends on a shared store, what it
    moved; `out` writes one."""

    def __init__(self, out: Callable[[str], None]):
        self.out = out

    def after_stage(self, run: Run, outcome: Outcome) -> None:
        self.out(describe(outcome))

    def after_run(self, run: Run, status: str) -> None:
        if status == "FINISHED" and (line := run.transfer_line()):
            self.out(line)


RESUME_NOTE = "committed stages stay in the store, the next run resumes from them"


def terminated(signum: int, frame: object) -> None:
    """SIGTERM: exit 143 through SystemExit, so that exit hooks (a temporary Prefect server's stop) run."""
    print(f"terminated; {RESUME_NOTE}", file=sys.stderr)
    raise SystemExit(128 + signum)


def honour_stop_signals() -> None:
    """Ctrl-C and SIGTERM stop the command however it was started: a process started in a script's
    background (`cmd &`) inherits SIGINT *ignored*, and Python then installs no KeyboardInterrupt handler;
    SIGTERM's default would end the process without a word or an exit hook."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, terminated)


@dataclass
class ExitCode:
    code: int = 0


@contextlib.contextmanager
def user_errors() -> Iterator[ExitCode]:
    """Around a command's body (Ctrl-C and SIGTERM honoured): a FinetuneError becomes one line on stderr
    and its exit code (2), Ctrl-C exit code 130; the command returns `.code` after the block."""
    honour_stop_signals()
    result = ExitCode()
    try:
        yield result
    except FinetuneError as e:
        print(f"error: {e}", file=sys.stderr)
        result.code = e.exit_code
    except KeyboardInterrupt:
        print(f"interrupted; {RESUME_NOTE}", file=sys.stderr)
        result.code = 130


def guarded(fn: Callable[[], int | None]) -> int:
    """fn() under `user_errors`: its return value, else the error's exit code."""
    with user_errors() as result:
        return fn() or 0
    return result.code


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
