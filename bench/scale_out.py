"""Scale-out on simulated machines (tests/cluster.py: a Prefect server, a `process` work pool, workers with
their own local caches; moto's S3 server on 127.0.0.1 as the shared store), in one run:

    1 vs 2 workers    a 4-variant tiny-imdb sweep (`flows.sweep --on-workers --parallel 4`, train.lr x 4,
                      one torch thread per worker) on a fresh store: wall time, and the ratio
    s3 vs local       the same sweep rerun fully cached on 2 fresh workers (empty local caches), store on
                      s3:// vs a local path (both workers on this computer see it): wall time, the ratio,
                      and what the cached rerun's runs moved to and from S3 (their run records' `transfers`:
                      GET/PUT requests and bytes; lazy fetch: manifests only)

    .venv/bin/python bench/scale_out.py [--work DIR] [--repeat N] [--train-rows N] [--api URL]
    .venv/bin/python bench/scale_out.py --smoke     # --repeat 1 --train-rows 8, 1 variant (a Prefect server, moto, workers)

--smoke fills the stores the cached reruns read with its two timed sweeps (1 worker: s3; 2 workers: local)
instead of a third, untimed one.

Each kind of timing is taken --repeat times (default 3), interleaved (1 worker, 2 workers, 1, 2, ...; then
cached s3, cached local, ...); the table gives the medians, each timing beside them.

Goals (issue 31): >= 1.7x for 2 workers on 2 free cores; <= 1.2x for the cached rerun on s3; <= 1 MB moved by
the cached rerun. `uptime`'s load averages (1, 5, 15 min) are printed beside each timing: on a shared
machine the first ratio is bounded by the cores the other jobs leave; rerun when the load is above 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from benchlib import parser, require  # noqa: E402

TRAIN_ROWS = 96  # the sweep; --train-rows N gives each variant more training


def cli() -> argparse.ArgumentParser:
    p = parser(__doc__)
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--repeat", type=int, default=3, help="timings of each kind, interleaved (default 3); the table "
                   "gives their medians")
    p.add_argument("--train-rows", type=int, default=TRAIN_ROWS, help=f"training rows per variant (default "
                   f"{TRAIN_ROWS}, the issue's sweep); more rows give each run more work beside the same overheads")
    p.add_argument("--api", help="the API URL of a running Prefect server to use (a pool of its own on it) instead "
                   "of starting one (the test suite's)")
    return p


if __name__ == "__main__":
    cli().parse_args()  # --help and a bad flag answered before the heavy imports below
    require("moto", "s3fs")

import psutil  # noqa: E402
from cluster import base_env, machines, orchestrator, run  # noqa: E402
from s3server import moto_server, s3_env  # noqa: E402

from flows.reports.formatting import markdown_table  # noqa: E402
from stages.engine.units import human_bytes  # noqa: E402

POOL = f"scale-out-{uuid.uuid4().hex[:6]}"  # a pool of its own, also on a server other runs use (--api)
LRS = ("1e-3", "7e-4", "5e-4", "3e-4")  # the sweep's variants; --smoke takes the first (the paths, not the spread: tests/flows/test_two_machines.py)


def sweep_command(train_rows: int = TRAIN_ROWS, lrs: tuple[str, ...] = LRS) -> list[str]:
    return ["-m", "flows.sweep", "tiny-imdb", "--grid", f"train.lr={','.join(lrs)}",
            "--set", f"data.subset={{train: {train_rows}, validation: 8, test: 8}}", "--parallel", str(len(lrs)),
            "--on-workers"]


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


ROLES = (("prefect server", "server start"), ("moto (S3)", "werkzeug"), ("workers", "worker start"),
         ("flow runs", "prefect.engine"), ("sweep command", "flows.sweep"))


class CpuMeter:
    """CPU seconds (user + system) each role's processes used, sampled from this process's descendants every
    0.2 s while it runs (a process that ends between samples loses at most its last 0.2 s)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[str, float]] = {}
        self.start: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _poll(self, first: bool = False) -> None:
        for p in psutil.Process().children(recursive=True):
            try:
                cmd, t = " ".join(p.cmdline()), p.cpu_times()
            except psutil.Error:
                continue
            role = next((r for r, needle in ROLES if needle in cmd), "other")
            if first:
                self.start[p.pid] = t.user + t.system
            self.seen[p.pid] = (role, t.user + t.system)

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            self._poll()

    def __enter__(self) -> CpuMeter:
        self._poll(first=True)  # the server and moto ran before: only what they use from here counts
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()

    def by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, (role, t) in self.seen.items():
            out[role] = out.get(role, 0.0) + t - self.start.get(pid, 0.0)
        return out


def sweep(env: dict[str, str], tmp: Path, store: str, workers: list[str], train_rows: int = TRAIN_ROWS,
          lrs: tuple[str, ...] = LRS) -> tuple[float, str, Path, dict[str, float]]:
    """Wall time of the sweep with these workers on this store (a fresh machine folder each), the load
    average at its end, the folder of its machines and the CPU seconds per role (workers started to end)."""
    folder = tmp / f"{uuid.uuid4().hex[:6]}"
    with CpuMeter() as cpu, machines({**env, "FINETUNE_STORE": store}, folder, *workers, pool=POOL):
        t0 = time.perf_counter()
        run([sys.executable, *sweep_command(train_rows, lrs)], {**env, "FINETUNE_STORE": store, "FINETUNE_CACHE": str(folder / "o")},
            timeout=1800)
        wall = time.perf_counter() - t0
    return wall, load(), folder, cpu.by_role()


def moved(folder: Path) -> dict[str, int]:
    """The transfers of every run the workers in `folder` ran (their run records), summed."""
    total: dict[str, int] = {}
    runs = list(folder.glob("*/cache/*/runs/*.json"))
    for f in runs:
        for k, v in (json.loads(f.read_text()).get("transfers") or {}).items():
            total[k] = total.get(k, 0) + v
    total["runs"] = len(runs)
    return total


def main() -> int:
    args = cli().parse_args()
    if args.smoke:
        args.repeat, args.train_rows = 1, 8
    lrs = LRS[:1] if args.smoke else LRS
    tmp = args.work or Path(tempfile.mkdtemp(prefix="scale-out-"))
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"load before: {load()}", flush=True)
    times: dict[str, list[float]] = {"one": [], "two": [], "cached_s3": [], "cached_local": []}
    loads: dict[str, list[str]] = {k: [] for k in times}

    cpu: dict[str, list[dict[str, float]]] = {k: [] for k in times}

    def timed(kind: str, env: dict[str, str], store: str, workers: list[str]) -> Path:
        t, at_end, folder, used = sweep(env, tmp, store, workers, args.train_rows, lrs)
        times[kind].append(t)
        cpu[kind].append(used)
        loads[kind].append(at_end)
        print(f"{kind}: {t:.1f} s (load {at_end})", flush=True)
        return folder

    with moto_server() as endpoint:
        os.environ.update(s3_env(endpoint))
        import s3fs

        s3fs.S3FileSystem().mkdir("bench")
        s3, local = f"s3://bench/{uuid.uuid4().hex[:8]}", str(tmp / "local-store")
        with orchestrator(base_env(tmp, s3), tmp, ["tiny-imdb"], api=args.api, pool=POOL) as env:
            if args.smoke:  # each on a fresh store, which the cached reruns then read: one sweep less to run
                timed("one", env, s3, ["a"])
                timed("two", env, local, ["a", "b"])
            for i in range(0 if args.smoke else args.repeat):  # each on a fresh store; the last 2-worker one fills `s3`
                timed("one", env, f"s3://bench/{uuid.uuid4().hex[:8]}", ["a"])
                timed("two", env, s3 if i == args.repeat - 1 else f"s3://bench/{uuid.uuid4().hex[:8]}", ["a", "b"])
            if not args.smoke:
                sweep(env, tmp, local, ["a", "b"], args.train_rows, lrs)  # fill the local store
            for _ in range(args.repeat):
                folder = timed("cached_s3", env, s3, ["a", "b"])
                timed("cached_local", env, local, ["a", "b"])
            bytes_ = moved(folder)  # the last cached rerun on s3
    m = {k: statistics.median(v) for k, v in times.items()}
    runs = {k: ", ".join(f"{t:.1f}" for t in v) for k, v in times.items()}
    rows = [["", "", "", "ratio of medians", "load avg 1/5/15 at each end"],
            [f"{len(lrs)}-variant sweep, fresh store", f"1 worker {m['one']:.1f} s ({runs['one']})",
             f"2 workers {m['two']:.1f} s ({runs['two']})", f"{m['one'] / m['two']:.2f}x (goal >= 1.7)",
             "; ".join(loads["one"] + loads["two"])],
            ["same sweep all cached, 2 fresh workers", f"local {m['cached_local']:.1f} s ({runs['cached_local']})",
             f"s3 {m['cached_s3']:.1f} s ({runs['cached_s3']})",
             f"{m['cached_s3'] / m['cached_local']:.2f}x (goal <= 1.2)",
             "; ".join(loads["cached_local"] + loads["cached_s3"])],
            ["cached rerun on s3: what its runs moved", f"{bytes_.get('runs', 0)} runs",
             f"{bytes_.get('get', 0)} GET {human_bytes(bytes_.get('get_bytes', 0))}",
             f"{bytes_.get('put', 0)} PUT {human_bytes(bytes_.get('put_bytes', 0))}, "
             f"{bytes_.get('other', 0)} other requests", "(goal: manifests only, <= 1 MB)"]]
    roles = [r for r, _ in ROLES] + ["other"]
    cpu_rows = [["CPU seconds (median)", *roles, "all", "all / 2 cores"]]
    for kind, label in (("one", "1 worker, fresh store"), ("two", "2 workers, fresh store"),
                        ("cached_s3", "2 workers, cached, s3"), ("cached_local", "2 workers, cached, local")):
        per = {r: statistics.median(c.get(r, 0.0) for c in cpu[kind]) for r in roles}
        total = statistics.median(sum(c.values()) for c in cpu[kind])
        cpu_rows.append([label, *(f"{per[r]:.1f}" for r in roles), f"{total:.1f}", f"{total / 2:.1f} s"])
    print(f"\ncores: {os.cpu_count()}, torch threads per worker: 1, {args.train_rows} training rows per variant, "
          f"{args.repeat} timings of each kind (medians; "
          f"each timing in brackets)")
    print(markdown_table(rows))
    print("\nwhere the CPU went (a sweep's processes, from its workers' start to its end; 'all / 2 cores' is the "
          "shortest the sweep could take if nothing waited):")
    print(markdown_table(cpu_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
