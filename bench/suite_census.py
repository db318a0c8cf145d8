"""Where the suite's CPU goes: the README's test command run once with a census of every Python process it starts.

A `.pth` hook is put into this virtual environment's site-packages for the run (and removed after it), so every
Python process of the venv that the run starts, `python -I` ones included, records its start (the command, the test
that started it, from PYTEST_CURRENT_TEST) and, at a normal exit, its CPU seconds. The run's environment names the
census file: other Python processes of the venv record nothing, nor does one started with an environment that drops
it (a test's minimal one; the total CPU line still counts it). A process killed by a signal (kill -9, or one a
test stops on purpose) records its start only: its count is exact, its CPU a lower bound. The table groups the
processes by what they run and lists the tests that start the most.

    .venv/bin/python bench/suite_census.py               # the whole suite (the README's test command), ~13 min
    .venv/bin/python bench/suite_census.py tests/flows   # any pytest arguments after the script
    .venv/bin/python bench/suite_census.py --smoke       # one test that starts one process, -n 0

Run it on a quiet machine, nothing else on the cores: it prints the load average before and after.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import site
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchlib import header, parser, row  # noqa: E402

CENSUS_ENV = "FINETUNE_CENSUS"  # the census file, set for the run: a process without it records nothing
# the smoke: one test that starts one Python process, in one pytest process
SMOKE = ["tests/common/test_progress.py::test_a_log_that_is_not_a_terminal_gets_lines_never_carriage_returns",
         "-n", "0", "-p", "no:cacheprovider"]
# what the .pth file runs at every start of the venv's Python: the hook is imported only under the census
PTH = f"import os; os.environ.get({CENSUS_ENV!r}) and __import__('zz_finetune_census')\n"
HOOK = '''
import atexit, json, os, resource, sys, time
_OUT, _T0 = os.environ[{env!r}], time.monotonic()
def _write(rec):
    try:
        with open(_OUT, "a") as f:
            f.write(json.dumps(rec) + "\\n")
    except OSError:
        pass
_write({{"pid": os.getpid(), "start": True, "argv": list(getattr(sys, "orig_argv", sys.argv))[1:7],
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}})
def _exit():
    r = resource.getrusage(resource.RUSAGE_SELF)
    _write({{"pid": os.getpid(), "cpu": r.ru_utime + r.ru_stime, "wall": time.monotonic() - _T0}})
atexit.register(_exit)
'''


def kind(argv: list[str]) -> str:
    """What a process runs, in a few words."""
    text = " ".join(" ".join(argv).split())  # a `python -c` program's lines as one: one table row
    for needle, name in [("exec(eval(sys.stdin", "pytest worker (xdist)"), ("-m pytest", "pytest"),
                         ("prefect server start", "prefect server"), ("prefect worker", "prefect worker"),
                         ("accelerate.commands.launch", "accelerate launch"),
                         ("stages.training.distributed", "a launched train process"),
                         ("-m stages", "python -m stages"), ("flows.inspect", "inspect (flows.inspect, finetune)"),
                         ("finetune inspect", "inspect (flows.inspect, finetune)"), ("flows.serve", "flows.serve"),
                         ("flows.sweep", "flows.sweep"), ("flows.finetune", "flows.finetune, finetune run"),
                         ("finetune run", "flows.finetune, finetune run"), ("flows.", "other flows.*"),
                         ("bin/finetune", "finetune (other subcommands)"), ("bin/prefect", "prefect CLI"), ("prefect", "python -c with prefect"), ("moto", "moto S3 server"),
                         ("multiprocessing", "multiprocessing child"), ("loky", "joblib worker"), ("mypy", "mypy"),
                         ("-m pip", "pip"), ("-I", "python -I (an export alone)")]:
        if needle in text:
            return name
    return "other: " + text[:60]


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        parser(__doc__).print_help()
        print("\nany other arguments are pytest's, e.g. tests/flows")
        return 0
    args = SMOKE if argv == ["--smoke"] else argv
    out = Path(tempfile.mkdtemp(prefix="suite-census-")) / "census.jsonl"
    pth = Path(site.getsitepackages()[0]) / "zz_finetune_census.pth"
    module = pth.with_name("zz_finetune_census.py")
    module.write_text(HOOK.format(env=CENSUS_ENV))
    pth.write_text(PTH)
    print("load average before:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    t0, r0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        # PYTEST_CURRENT_TEST of a pytest this census runs in is not the test that started the run's processes
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        rc = subprocess.call([sys.executable, "-m", "pytest", *args], cwd=ROOT, env={**env, CENSUS_ENV: str(out)})
    finally:
        pth.unlink(missing_ok=True)
        module.unlink(missing_ok=True)
    wall = time.monotonic() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    total_cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    print("load average after:", " ".join(f"{x:.2f}" for x in os.getloadavg()))

    starts, cpu = {}, {}
    for line in out.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("start"):
            starts[rec["pid"]] = rec
        else:
            cpu[rec["pid"]] = rec["cpu"]
    by_kind: dict[str, list[float | None]] = collections.defaultdict(list)
    by_test: dict[str, list[float | None]] = collections.defaultdict(list)
    for pid, rec in starts.items():
        by_kind[kind(rec["argv"])].append(cpu.get(pid))
        if rec["test"]:
            by_test[rec["test"]].append(cpu.get(pid))
    measured = sum(c for c in cpu.values())
    print(f"\npytest exit {rc}; {wall:.0f} s wall; {total_cpu:.0f} CPU-s in all (every process the run waited for); "
          f"{len(starts)} Python processes, {measured:.0f} CPU-s recorded by those that exited normally\n")
    header(["processes running", "count", "exited normally", "their CPU-s", "CPU-s each (median)"])
    for name, cs in sorted(by_kind.items(), key=lambda kv: -sum(c or 0 for c in kv[1])):
        done = sorted(c for c in cs if c is not None)
        med = done[len(done) // 2] if done else float("nan")
        row([name, len(cs), len(done), f"{sum(done):.0f}", f"{med:.1f}"])
    print()
    header(["test", "processes", "their CPU-s (normal exits)"])
    for test, cs in sorted(by_test.items(), key=lambda kv: -sum(c or 0 for c in kv[1]))[:25]:
        row([test, len(cs), f"{sum(c for c in cs if c is not None):.0f}"])
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
