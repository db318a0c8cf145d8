"""Ctrl-C (SIGINT) and SIGTERM during training: noted, acted on at the next micro-batch, then passed on.

The train loop runs inside `DeferredStop`. A signal there only sets `signum`; the loop looks at it before
every micro-batch (an unfinished optimizer step is abandoned: its gradients dropped, the RNG put back to
the step's start) and after every step, writes a resume checkpoint at the last finished step, and calls
`deliver()`: the handlers that were there before come back and the one for the signal is called, so whatever
it does (KeyboardInterrupt, Prefect marking the run Crashed, exit 143) happens as if it had just arrived. A
second signal while the checkpoint is written is delivered at once. The wait is bounded by one
micro-batch (or one validation) plus the checkpoint's save.

Only in the main thread (Python runs signal handlers there alone) and only for signals not ignored; in
several processes (train.num_processes > 1) each process keeps its own handlers (ranks would have to
agree on the step), so a stop there resumes from the last periodic checkpoint.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

from stages.training.checkpoint import rng_state, set_rng_state

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StepAbandoned(Exception):
    """Raised between micro-batches when a stop was requested: the step's partial gradients are dropped."""


class DeferredStop:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}
        self.step_rng: dict[str, Any] | None = None

    def __enter__(self) -> DeferredStop:
        if self.enabled:
            for sig in STOP_SIGNALS:
                before = signal.getsignal(sig)
                if before in (signal.SIG_IGN, None):  # ignored stays ignored; None: set outside Python
                    continue
                self.previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # a second signal: no more waiting
            self.deliver()
        self.signum = signum

    def _restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    @property
    def name(self) -> str:
        names = {int(signal.SIGINT): "Ctrl-C (SIGINT)", int(signal.SIGTERM): "SIGTERM"}
        return names.get(self.signum, f"signal {self.signum}") if self.signum is not None else "a signal"

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def step_starts(self) -> None:
        """An optimizer step begins: its RNG state kept, to be put back if the step is abandoned."""
        if self.enabled:
            self.step_rng = rng_state()

    def rewind(self, optimizer: Any) -> None:
        """An abandoned step: its partial gradients dropped, the RNG as at its start (a resumed run then
        redoes the step exactly)."""
        optimizer.zero_grad(set_to_none=True)
        if self.step_rng is not None:
            set_rng_state(self.step_rng)

    def check(self) -> None:
        """Between micro-batches: a requested stop abandons the step."""
        if self.signum is not None:
            raise StepAbandoned

    def deliver(self) -> None:
        """The handlers from before, and the signal sent to them (their exception is raised from here)."""
        signum, handler = self.signum, self.previous.get(self.signum) if self.signum is not None else None
        self._restore()
        if signum is None:
            return
        if callable(handler):
            handler(signum, None)
        else:  # SIG_DFL: the signal's default action (the process ends at once)
            os.kill(os.getpid(), signum)
