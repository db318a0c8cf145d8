"""What a run pays beside its stages' work, and what issue 31 cut from it, each measured in this run:

    code walk        fingerprinting the project's code for every stage's key: walked (a fresh process on a
                     machine that never planned this checkout) vs remembered (~/.cache/finetune-code: any other
                     fresh process, whatever its store or FINETUNE_CACHE)
    task arguments   Prefect's search of a stage task's arguments for futures (the plan, the item, the store,
                     the outcomes so far, after a whole tiny-imdb run): as they are vs quoted, as the flow passes them
    process exit     a process that imported torch, transformers, datasets, peft and the flow module: from its
                     last statement to its end, without and with the flow module's gc.freeze at exit

    .venv/bin/python bench/run_overhead.py [--repeat 5]
    .venv/bin/python bench/run_overhead.py --smoke       # --repeat 1

Medians of --repeat timings, interleaved. Needs ../shared/data (the tiny-imdb run). Prints `uptime`'s load.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchlib import parser  # noqa: E402

EXIT_CHILD = r"""
import atexit, gc, sys, time
import datasets, peft, torch, transformers
import flows.orchestration.finetune_flow  # registers gc.freeze at exit
from transformers import AutoModelForSequenceClassification
if sys.argv[1] == "without":
    atexit.unregister(gc.freeze)
print(time.time(), flush=True)
"""


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def exit_s(mode: str) -> float:
    """Seconds from the child's last statement to the end of its process."""
    out = subprocess.run([sys.executable, "-c", EXIT_CHILD, mode], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    return time.time() - float(out.stdout.split()[-1])


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    if args.smoke:
        args.repeat = 1
    print(f"load before: {load()}", flush=True)

    from prefect.utilities.annotations import quote
    from prefect.utilities.engine import collect_task_run_inputs_sync

    from flows.reports.formatting import markdown_table
    from stages.engine import fingerprint
    from stages.engine.codegraph import CodeGraph
    from stages.engine.paths import PROJECT_ROOT
    from stages.engine.runner import execute
    from stages.engine.stage import code_roots
    from stages.engine.store import Store
    from stages.graph import GRAPH
    from stages.pipeline.loading import load_pipeline

    t: dict[str, list[float]] = {k: [] for k in ("walked", "remembered", "args", "quoted", "exit", "exit_frozen")}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        cfg = load_pipeline("tiny-imdb", ["data.subset={train: 32, validation: 8, test: 8}"])
        plan = GRAPH.plan(cfg, store)
        outcomes = execute(plan, store)
        done = {o.stage: o for o in outcomes}
        item = plan.items[-1]
        memo_path = Path(tmp) / "code.sqlite"
        for i in range(args.repeat):
            t0 = time.perf_counter()  # a fresh code graph: nothing parsed in this process yet
            graph = CodeGraph(PROJECT_ROOT)
            for st in GRAPH:
                fingerprint.code_fingerprint(code_roots(st), graph)
            t["walked"].append(time.perf_counter() - t0)
            memo = fingerprint.HashMemo(memo_path)
            if i == 0:
                for st in GRAPH:
                    fingerprint.remembered_code_fingerprint(code_roots(st), memo)
            t0 = time.perf_counter()
            memo = fingerprint.HashMemo(memo_path)  # a new process's memo object: reads the file
            for st in GRAPH:
                fingerprint.remembered_code_fingerprint(code_roots(st), memo)
            t["remembered"].append(time.perf_counter() - t0)
            for kind, wrap in (("args", lambda x: x), ("quoted", quote)):
                t0 = time.perf_counter()
                for _ in GRAPH:  # one task per stage
                    collect_task_run_inputs_sync({"plan": wrap(plan), "item": wrap(item), "store": wrap(store),
                                                  "done": wrap(done)})
                t[kind].append((time.perf_counter() - t0) / len(GRAPH.names))
            t["exit"].append(exit_s("without"))
            t["exit_frozen"].append(exit_s("with"))
            print(f"  repeat {i + 1}: walked {t['walked'][-1]:.2f} s, remembered {t['remembered'][-1]:.3f} s, "
                  f"exit {t['exit'][-1]:.2f} s, frozen {t['exit_frozen'][-1]:.2f} s", flush=True)
    m = {k: statistics.median(v) for k, v in t.items()}
    rows = [["", "before", "now", "saved"],
            ["code walk, all stages (a fresh process)", f"{m['walked']:.2f} s walked", f"{m['remembered']:.3f} s "
             "remembered", f"{m['walked'] - m['remembered']:.2f} s"],
            ["Prefect's argument search, per stage task", f"{m['args'] * 1000:.0f} ms", f"{m['quoted'] * 1000:.1f} ms "
             "quoted", f"{(m['args'] - m['quoted']) * len(GRAPH.names):.2f} s a run ({len(GRAPH.names)} tasks)"],
            ["process exit after torch + transformers", f"{m['exit']:.2f} s", f"{m['exit_frozen']:.2f} s with "
             "gc.freeze", f"{m['exit'] - m['exit_frozen']:.2f} s a run"]]
    print(f"\nmedians of {args.repeat}; load at the end: {load()}")
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
