"""Progress of a long loop, shown the way its output is read.

In a terminal: a tqdm bar (count, rate, elapsed, ETA, and what `set_postfix` adds: loss, lr, tokens/s),
with log lines written above it instead of through it. Elsewhere (CI, `make demo | tee`, a Prefect
worker's or deployment's log, the Prefect UI): no bar redrawn per batch, but one log line each time
another N% is done, with the same figures and the ETA; the UI receives these, never a bar.

    FINETUNE_PROGRESS=bar|log|off   force a mode (default: bar when stderr is a terminal, else log)
    FINETUNE_PROGRESS_PERCENT=N     log mode: a line every N% (default 10)
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

T = TypeVar("T")


def mode() -> str:
    forced = os.environ.get("FINETUNE_PROGRESS", "").strip().lower()
    if forced in ("bar", "log", "off"):
        return forced
    return "bar" if sys.stderr.isatty() else "log"


def every_percent() -> float:
    try:
        return min(max(float(os.environ.get("FINETUNE_PROGRESS_PERCENT", "10")), 1.0), 100.0)
    except ValueError:
        return 10.0


def clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds))) if math.isfinite(seconds) else "?"


class Progress:
    """tqdm's `update` / `set_postfix` / `close`, as a bar or as log lines every N% (see the module)."""

    def __init__(self, total: int, desc: str, log: logging.Logger, *, initial: int = 0, unit: str = "step",
                 leave: bool = True, summary: bool = True, quiet_s: float = 0.0):
        self.total, self.desc, self.log, self.unit, self.summary = total, desc, log, unit, summary
        self.units = unit + ("es" if unit.endswith(("s", "x", "ch", "sh")) else "s")
        self.quiet_s = quiet_s  # log mode: no line before this many seconds (short loops stay silent)
        self.n = self.start_n = initial
        self.postfix: dict[str, Any] = {}
        self.started = time.perf_counter()
        self.mode = mode()
        self.step = every_percent()
        self.next_percent = (math.floor(100 * initial / max(total, 1) / self.step) + 1) * self.step
        self.bar = None
        self._redirect: contextlib.ExitStack | None = None
        if self.mode == "bar":
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=leave, dynamic_ncols=True)
            self._redirect = contextlib.ExitStack()  # log lines go above the bar, not through it
            self._redirect.enter_context(logging_redirect_tqdm(loggers=[logging.root]))  # where consoles are

    def set_postfix(self, **figures: Any) -> None:
        self.postfix = figures
        if self.bar is not None:
            self.bar.set_postfix(**figures)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.mode == "log" and self.total and 100 * self.n / self.total >= self.next_percent - 1e-9:
            percent = 100 * self.n / self.total
            self.next_percent = (math.floor(percent / self.step) + 1) * self.step
            if self.elapsed() >= self.quiet_s:
                self.log.info("%s: %3.0f%% (%d/%d %s)%s | elapsed %s | ETA %s", self.desc, percent, self.n,
                              self.total, self.units, self.figures(), clock(self.elapsed()), clock(self.eta()))

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def eta(self) -> float:
        done = self.n - self.start_n
        return (self.total - self.n) * self.elapsed() / done if done > 0 else math.inf

    def figures(self) -> str:
        return "".join(f" | {k.replace('_', '/')} {v}" for k, v in self.postfix.items())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None
        if self.summary and self.mode != "off":  # one line for logs and the Prefect UI, whatever the mode
            self.log.info("%s: %s, %d/%d %s in %s%s", self.desc, "done" if self.n >= self.total else "stopped",
                          self.n, self.total, self.units, clock(self.elapsed()), self.figures())
            self.summary = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iterate(items: Iterable[T], desc: str, log: logging.Logger, *, unit: str = "batch") -> Iterator[T]:
    """Progress over the items of a sized loop (a bar that leaves no trace, or log lines)."""
    items = list(items)
    with Progress(len(items), desc, log, unit=unit, leave=False, summary=False, quiet_s=2.0) as bar:
        for item in items:
            yield item
            bar.update(1)
