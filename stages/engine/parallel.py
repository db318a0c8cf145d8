"""CPU-parallel work with joblib: how many workers, and a map over chunks that returns results in input
order, so a parallel run gives exactly what the serial loop gives.

Workers: the cores this process may use (its CPU affinity and cgroup quota, as joblib counts them), or
$FINETUNE_JOBS when set (1 = serial). Small inputs stay serial: starting workers costs more than it saves.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def available_cores() -> int:
    from joblib import cpu_count

    return max(1, cpu_count())


def n_jobs(requested: int | None = None) -> int:
    """Workers to use: `requested`, else $FINETUNE_JOBS, else every available core."""
    if requested is not None:
        return max(1, requested)
    env = os.environ.get("FINETUNE_JOBS", "").strip()
    return max(1, int(env)) if env.isdigit() else available_cores()


def chunked(items: Sequence[T], parts: int) -> list[Sequence[T]]:
    """`items` cut into `parts` contiguous slices of near-equal size (none empty)."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def map_chunks(fn: Callable[..., list[R]], items: Sequence[T], *, jobs: int | None = None,
               min_items: int = 1, prefer: str = "processes", chunks_per_job: int = 4, **kw: Any) -> list[R]:
    """fn over contiguous chunks of `items`, concatenated in input order: `fn(items)` exactly, computed by
    `jobs` workers (joblib; `prefer` "threads" for I/O or code that releases the GIL). Serial when one
    worker or fewer than `min_items` items."""
    workers = n_jobs(jobs)
    if workers == 1 or len(items) < max(min_items, 2):
        return list(fn(items, **kw))
    from joblib import Parallel, delayed

    parts = chunked(items, workers * chunks_per_job)
    results = Parallel(n_jobs=workers, prefer=prefer)(delayed(fn)(part, **kw) for part in parts)
    return [r for part in results for r in part]
