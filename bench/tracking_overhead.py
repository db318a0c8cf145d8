"""What MLflow tracking costs the demo's train stage: the stage recomputed with tracking off and on, interleaved in
one run, against a real `mlflow server` on 127.0.0.1 (sqlite; tests/mlflowserver.py). Each run is a fresh
`python -m stages PIPELINE --only train --force train [--track]` process, so the tracked runs pay MLflow's
import too. The table gives medians of the train stage's own time (its manifest's duration_s), the whole
command's wall time and its CPU seconds (the tracking thread included), the ratios on/off (goal: <= 1.02), and
what the tracked runs sent (metric points, log_batch requests: read back from the server).

    .venv/bin/python bench/tracking_overhead.py                                   # the demo's train stage, 3 pairs
    .venv/bin/python bench/tracking_overhead.py --pairs 2 --set train.max_steps=16  # shorter
    .venv/bin/python bench/tracking_overhead.py --smoke                           # tiny-imdb, 2 steps, 1 pair
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from benchlib import header, parser, require, row  # noqa: E402

SMOKE = ["data.subset={train: 32, validation: 8, test: 8}", "train.max_steps=2"]


def run(args: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall s, CPU s of the process and its children, output)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "stages", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"python -m stages {' '.join(args)} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, out.stdout + out.stderr


def train_seconds(output: str) -> float:
    """The train stage's compute time, from its line (`  train      computed    170.6s  ...`)."""
    for line in output.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "train" and parts[1] == "computed":
            return float(parts[2].rstrip("s"))
    raise SystemExit(f"no train line in:\n{output[-2000:]}")


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("pipeline", nargs="?", default="demo")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--pairs", type=int, default=3, help="off/on pairs, interleaved (the order alternates)")
    args = ap.parse_args()
    require("mlflow")
    from mlflowserver import mlflow_server

    if args.smoke:
        args.pipeline, args.sets, args.pairs = "tiny-imdb", SMOKE, 1
    sets = [a for s in args.sets for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    env.pop("FINETUNE_TRACK", None)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.pipeline} {' '.join(args.sets)}; OMP_NUM_THREADS "
          f"{env['OMP_NUM_THREADS']}", flush=True)
    run([args.pipeline, *sets, "--until", "adapters"], env)  # the train stage's upstream, once (a hit if stored)
    experiment = f"bench-{uuid.uuid4().hex[:8]}"
    rows: dict[str, list[tuple[float, float, float]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp, mlflow_server(Path(tmp)) as (url, _):
        tracked = {**env, "MLFLOW_TRACKING_URI": url, "MLFLOW_EXPERIMENT_NAME": experiment}
        for i in range(args.pairs):
            for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                extra = ["--track"] if mode == "on" else []
                wall, cpu, out = run([args.pipeline, *sets, "--only", "train", "--force", "train", *extra],
                                     tracked if mode == "on" else env)
                rows[mode].append((train_seconds(out), wall, cpu))
                print(f"  pair {i + 1} {mode:<3}  train {rows[mode][-1][0]:7.1f} s  command {wall:7.1f} s  "
                      f"CPU {cpu:7.1f} s  load {os.getloadavg()[0]:.2f}", flush=True)
        from mlflow import MlflowClient

        c = MlflowClient(url)
        runs = c.search_runs([c.get_experiment_by_name(experiment).experiment_id])
        points = [sum(len(c.get_metric_history(r.info.run_id, k)) for k in r.data.metrics) for r in runs]
        requests = log_batch_requests(Path(tmp) / "mlflow-server.log")
    med = {m: [statistics.median(x[j] for x in rows[m]) for j in range(3)] for m in rows}
    print()
    header(["tracking", "train stage s", "command s", "CPU s"])
    for m in ("off", "on"):
        row([m, f"{med[m][0]:.1f}", f"{med[m][1]:.1f}", f"{med[m][2]:.1f}"])
    row(["on / off", *(f"{med['on'][j] / med['off'][j]:.3f}" for j in range(3))])
    print(f"\n{len(runs)} tracked runs: {statistics.median(points):.0f} metric points each (median); "
          f"log_batch requests to the server in all: {requests}; load average {os.getloadavg()[0]:.2f}")
    print(json.dumps({"medians": med, "pairs": args.pairs}))
    return 0


def log_batch_requests(log: Path) -> int:
    return sum("runs/log-batch" in line for line in log.read_text(errors="replace").splitlines())


if __name__ == "__main__":
    raise SystemExit(main())
