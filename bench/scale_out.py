"""Scale-out on simulated machines (tests/cluster.py: a Prefect server, a `process` work pool, workers with
their own local caches; moto's S3 server on 127.0.0.1 as the shared store), in one run:

    1 vs 2 workers    a 4-variant tiny-imdb sweep (`flows.sweep --on-workers --parallel 4`, train.lr x 4,
                      one torch thread per worker) on a fresh store: wall time, and the ratio
    s3 vs local       the same sweep rerun fully cached on 2 workers, store on s3:// vs a local path
                      (both workers on this computer see it): wall time, and the ratio

    .venv/bin/python bench/scale_out.py [--work DIR]

Goals (issue 22): >= 1.7x for 2 workers on 2 free cores; <= 1.2x for the cached rerun on s3. The load
average is printed beside the numbers: on a shared machine the first ratio is bounded by the cores
the other jobs leave.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from cluster import base_env, machines, orchestrator, run  # noqa: E402
from s3server import moto_server, s3_env  # noqa: E402

SWEEP = ["-m", "flows.sweep", "tiny-imdb", "--grid", "train.lr=1e-3,7e-4,5e-4,3e-4",
         "--set", "data.subset={train: 96, validation: 8, test: 8}", "--parallel", "4", "--on-workers"]


def sweep(env: dict[str, str], tmp: Path, store: str, workers: list[str]) -> float:
    """Wall time of the sweep with these workers on this store (a fresh machine folder each)."""
    folder = tmp / f"{uuid.uuid4().hex[:6]}"
    with machines({**env, "FINETUNE_STORE": store}, folder, *workers):
        t0 = time.perf_counter()
        run([sys.executable, *SWEEP], {**env, "FINETUNE_STORE": store, "FINETUNE_CACHE": str(folder / "o")},
            timeout=1800)
        return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = p.parse_args()
    tmp = args.work or Path(tempfile.mkdtemp(prefix="scale-out-"))
    tmp.mkdir(parents=True, exist_ok=True)
    with moto_server() as endpoint:
        os.environ.update(s3_env(endpoint))
        import s3fs

        s3fs.S3FileSystem().mkdir("bench")
        s3, local = f"s3://bench/{uuid.uuid4().hex[:8]}", str(tmp / "local-store")
        with orchestrator(base_env(tmp, s3), tmp, ["tiny-imdb"]) as env:
            rows = []
            one = sweep(env, tmp, f"s3://bench/{uuid.uuid4().hex[:8]}", ["a"])
            load1 = os.getloadavg()[0]
            two = sweep(env, tmp, s3, ["a", "b"])
            load2 = os.getloadavg()[0]
            rows.append(("4-variant sweep, fresh store", f"1 worker {one:.1f} s", f"2 workers {two:.1f} s",
                         f"{one / two:.2f}x (goal >= 1.7)", f"load {load1:.1f} / {load2:.1f}"))
            sweep(env, tmp, local, ["a", "b"])  # fill the local store
            cached_s3 = sweep(env, tmp, s3, ["a", "b"])
            cached_local = sweep(env, tmp, local, ["a", "b"])
            rows.append(("same sweep, all cached, 2 workers", f"local {cached_local:.1f} s", f"s3 {cached_s3:.1f} s",
                         f"{cached_s3 / cached_local:.2f}x (goal <= 1.2)", f"load {os.getloadavg()[0]:.1f}"))
    print(f"\ncores: {os.cpu_count()}, torch threads per worker: 1")
    for r in rows:
        print(" | ".join(f"{c:<34}" if i == 0 else c for i, c in enumerate(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
