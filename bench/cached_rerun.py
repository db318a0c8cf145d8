"""A fully cached pipeline run through Prefect against Prefect's own floor: a 7-task no-op flow.

Both run as fresh processes on the same setup: the project's Prefect defaults (flows/orchestration/prefect_env.py: PREFECT_HOME
in the project, a temporary server started by the run on 127.0.0.1) and no Prefect server configured, so each
run starts and stops its own temporary server. The cached run is `python -m flows.finetune PIPELINE` with every
stage a store hit (the script runs it once first, untimed, to fill the store if needed); the no-op flow runs 7
tasks that return at once, in order, as the finetune flow runs its 7 stages. The two are interleaved, `--runs`
times each; the table shows medians and the ratio (goal: <= 1.1x). `--profile` also prints, for one cached run,
the heavy libraries it imported and the Prefect API requests it made by kind.

    .venv/bin/python bench/cached_rerun.py                       # the demo (computes it first if not stored)
    .venv/bin/python bench/cached_rerun.py --runs 5 --profile
    .venv/bin/python bench/cached_rerun.py --set data.subset='{train: 256, validation: 32, test: 256}'
    .venv/bin/python bench/cached_rerun.py --smoke     # tiny-imdb on 32 reviews, 1 run of each (~1 min)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchlib import header, parser, row  # noqa: E402

SMOKE = ["data.subset={train: 32, validation: 8, test: 8}", "train.max_steps=2"]

NOOP_FLOW = r"""
import flows.orchestration  # the project's Prefect defaults, as flows.finetune has them
from prefect import flow, task
from prefect.cache_policies import NONE

@task(cache_policy=NONE)
def noop(i):
    return i

@flow(name="noop")
def seven():
    for i in range(7):
        noop(i)

state = seven(return_state=True)
raise SystemExit(0 if state.is_completed() else 1)
"""

# Run inside the cached run's process (--profile): which heavy libraries got imported, and Prefect's API
# requests by method and route, counted as the client sends them.
PROFILE = r"""
import atexit, collections, runpy, sys
import httpx
calls = collections.Counter()
_send = httpx.AsyncClient.send
async def send(self, request, *a, **kw):
    path = request.url.path.split("/api/", 1)[-1]
    calls[request.method + " " + "/".join(p if not any(c.isdigit() for c in p) else "{id}" for p in path.split("/"))] += 1
    return await _send(self, request, *a, **kw)
httpx.AsyncClient.send = send
@atexit.register
def report():
    heavy = [m for m in ("torch", "transformers", "datasets", "peft", "accelerate", "pandas", "pyarrow", "numpy",
                         "safetensors", "bitsandbytes", "evaluate") if m in sys.modules]
    print("PROFILE heavy imports:", ", ".join(heavy) or "none", file=sys.stderr)
    print(f"PROFILE API requests: {sum(calls.values())}", file=sys.stderr)
    for k, n in calls.most_common():
        print(f"PROFILE   {n:4d}  {k}", file=sys.stderr)
sys.argv = ["flows.finetune", *sys.argv[1:]]
runpy.run_module("flows.finetune", run_name="__main__", alter_sys=True)
"""


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}  # no server: a temporary one
    out.update({"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    out.setdefault("OMP_NUM_THREADS", "1")
    return out


def timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])}... failed (exit {p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    return wall, p.stdout + p.stderr


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("pipeline", nargs="?", default="demo")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="an override, as flows.finetune takes")
    ap.add_argument("--runs", type=int, default=3, help="runs of each (the table shows medians)")
    ap.add_argument("--profile", action="store_true", help="also show one cached run's imports and API requests")
    args = ap.parse_args()
    if args.smoke:
        args.pipeline, args.sets, args.runs = "tiny-imdb", SMOKE, 1
    finetune = ["-m", "flows.finetune", args.pipeline, *(x for s in args.sets for x in ("--set", s))]

    first, out = timed([sys.executable, *finetune])  # fills the store if needed; untimed in the table
    computed = [line for line in out.splitlines() if "computed" in line and "cached" not in line]
    print(f"first run {first:.1f} s{' (computed stages)' if computed else ' (all cached)'}")
    results: dict[str, list[float]] = {"cached pipeline run": [], "7-task no-op flow": []}
    for r in range(args.runs):  # interleaved: machine noise spreads over both
        results["cached pipeline run"].append(timed([sys.executable, *finetune])[0])
        results["7-task no-op flow"].append(timed([sys.executable, "-c", NOOP_FLOW])[0])
        print(f"  run {r + 1}: cached {results['cached pipeline run'][-1]:.1f} s, "
              f"no-op {results['7-task no-op flow'][-1]:.1f} s", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    floor = med["7-task no-op flow"]
    print()
    header([f"run ({args.pipeline}{' ' + ' '.join(args.sets) if args.sets else ''})",
            f"wall s (median of {args.runs})", "runs", "vs no-op"], "-:-:")
    for k, v in results.items():
        row([k, f"{med[k]:.1f}", ", ".join(f"{x:.1f}" for x in v), f"{med[k] / floor:.2f}x"])
    if args.profile:
        _, out = timed([sys.executable, "-c", PROFILE, *finetune[2:]])
        print()
        print("\n".join(line.removeprefix("PROFILE ") for line in out.splitlines() if line.startswith("PROFILE")))


if __name__ == "__main__":
    main()
