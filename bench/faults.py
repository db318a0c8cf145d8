"""The fault table's probes, per stage (docs/faults.md): a `python -m stages` run stopped inside each stage by
SIGINT (Ctrl-C), SIGTERM and SIGKILL, and the same stage run on a full disk (a small tmpfs holding the store; needs
root, skipped otherwise). For each: the exit code, whether a traceback was printed, whether a part of the stage
was committed, and then the rerun: its exit code, which stages it computed (the stopped one and those after,
never one before), and `finetune inspect verify` over the result.

    .venv/bin/python bench/faults.py                      # tiny-imdb on 2,000 reviews; about 10 minutes
    .venv/bin/python bench/faults.py --signals SIGTERM --stages train --disk-full no
    .venv/bin/python bench/faults.py --smoke              # that on 32 reviews and 2 steps (5 processes)

A stop lands at a random point between the line of the stage before and the stage's own expected end (measured
by a first run), so over repeated runs it falls in imports, the body and the commit alike.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchlib import parser  # noqa: E402

STAGES = ["data", "tokenize", "model", "adapters", "train", "evaluate", "export"]
SETS = ["data.subset={train: 2000, validation: 200, test: 400}", "train.epochs=1"]
SMOKE_SETS = ["data.subset={train: 32, validation: 8, test: 8}", "train.max_steps=2"]
LINE = re.compile(r"^\s+(\w+)\s+(computed|cached)\b", re.M)


def command(pipeline: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "stages", pipeline, *(f"--set={s}" for s in SETS), *extra]


def env_for(store: Path) -> dict[str, str]:
    return {**os.environ, "FINETUNE_STORE": str(store), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(ROOT)}


def run(args: list[str], store: Path) -> tuple[int, str]:
    r = subprocess.run(args, cwd=ROOT, env=env_for(store), capture_output=True, text=True, timeout=900)
    return r.returncode, r.stdout + r.stderr


def stage_seconds(pipeline: str, scratch: Path) -> dict[str, float]:
    """Seconds from the line of the stage before to each stage's line, in a run of a fresh process."""
    store = scratch / "calibrate"
    p = subprocess.Popen(command(pipeline), cwd=ROOT, env=env_for(store), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    seconds, last = {}, time.monotonic()
    assert p.stdout is not None
    for line in p.stdout:
        if m := LINE.match(line):
            now = time.monotonic()
            seconds[m.group(1)], last = now - last, now
    assert p.wait() == 0, "the calibration run failed"
    return seconds


def stage_before(stage: str) -> str | None:
    return STAGES[STAGES.index(stage) - 1] if stage != STAGES[0] else None


def stop_inside(pipeline: str, stage: str, sig: signal.Signals, store: Path, window: float) -> tuple[int, str]:
    """Start the pipeline (its stages before `stage` cached) and send `sig` at a random point of `stage`."""
    before = stage_before(stage)
    p = subprocess.Popen(command(pipeline), cwd=ROOT, env=env_for(store), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert p.stdout is not None
    out = []
    if before is None:
        out.append(p.stdout.readline())  # the `pipeline ... -> store` line: the data stage is next
    else:
        for line in p.stdout:
            out.append(line)
            if (m := LINE.match(line)) and m.group(1) == before:
                break
    time.sleep(random.uniform(0.05, 0.9) * window)
    if p.poll() is None:
        os.kill(p.pid, sig)
    else:
        out.append("(ended before the signal)\n")
    rest, _ = p.communicate(timeout=300)
    return p.returncode, "".join(out) + rest


@contextlib.contextmanager
def small_disk(store: Path, free: int) -> Iterator[tuple[Path, Callable[[], None]]]:
    """`store` copied onto a 64 MB tmpfs filled up to `free` bytes: (the copy, a function that makes room)."""
    mount = store.parent / "full"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], check=True)
    try:
        shutil.copytree(store, mount / "store")
        with open(mount / "filler", "wb") as f:
            os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(mount).free - free)
        yield mount / "store", (mount / "filler").unlink
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def probe(pipeline: str, stage: str, how: str, template: Path, scratch: Path, window: float) -> dict[str, str]:
    store = scratch / f"{stage}-{how}" / "store"
    shutil.copytree(template, store)
    # room for the refs and the run record, not for the stage's output
    disk = small_disk(store, 20_480 if stage == "evaluate" else 65_536) if how == "disk full" \
        else contextlib.nullcontext((store, lambda: None))
    with disk as (where, make_room):
        if how == "disk full":
            code, out = run(command(pipeline), where)
        else:
            code, out = stop_inside(pipeline, stage, signal.Signals[how], where, window)
        committed = (where / stage).is_dir()
        tmp_left = len(list((where / ".tmp").glob("*"))) if (where / ".tmp").is_dir() else 0
        make_room()
        rerun_code, rerun = run(command(pipeline), where)
        verify_code, _ = run([sys.executable, "-m", "flows.inspect", "verify", pipeline,
                              *(f"--set={s}" for s in SETS)], where)
    computed = [m.group(1) for m in LINE.finditer(rerun) if m.group(2) == "computed"]
    last = [ln for ln in out.strip().splitlines() if ln.startswith(("error:", "interrupted", "terminated"))]
    landed = computed[0] if computed else "after the last stage"  # the first stage the stop left undone
    return {"stage": stage, "how": how, "landed in": landed, "exit": str(code),
            "traceback": "yes" if "Traceback" in out else "no",
            "stage committed": "yes" if committed else "no", ".tmp left": str(tmp_left),
            "rerun": f"{rerun_code}: computed {' '.join(computed) or 'nothing'}",
            "verify": "ok" if verify_code == 0 else f"exit {verify_code}",
            "said": (last[-1][:90] if last else "-")}


def main() -> None:
    global SETS
    p = parser(__doc__)
    p.add_argument("--pipeline", default="tiny-imdb")
    p.add_argument("--stages", nargs="+", default=STAGES, choices=STAGES)
    p.add_argument("--signals", nargs="+", default=["SIGINT", "SIGTERM", "SIGKILL"])
    p.add_argument("--disk-full", choices=["yes", "no", "auto"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.smoke:
        SETS, args.stages, args.signals, args.disk_full = SMOKE_SETS, ["train"], ["SIGTERM"], "no"
    random.seed(args.seed)
    disk_full = args.disk_full == "yes" or (args.disk_full == "auto" and os.geteuid() == 0)
    print(f"load average {os.getloadavg()[0]:.2f}; pipeline {args.pipeline} with {'; '.join(SETS)}")
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        scratch = Path(tmp)
        seconds = stage_seconds(args.pipeline, scratch)
        print("seconds per stage (fresh process):", {k: round(v, 1) for k, v in seconds.items()})
        rows = []
        for stage in args.stages:
            template = scratch / f"upstream-{stage}"
            if before := stage_before(stage):
                code, out = run(command(args.pipeline, "--until", before), template)
                assert code == 0, out[-2000:]
            else:
                template.mkdir()
            for how in [*args.signals, *(["disk full"] if disk_full else [])]:
                rows.append(probe(args.pipeline, stage, how, template, scratch, seconds[stage]))
                print(" | ".join(rows[-1].values()), flush=True)
    cols = list(rows[0])
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(r[c] for c in cols) + " |")


if __name__ == "__main__":
    main()
