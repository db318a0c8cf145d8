"""What the bench smoke tests share (tests/bench/test_benches.py, tests/bench/test_bench_heavy.py): a bench run as
`python bench/X.py` in a process of its own, and its markdown tables read back."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers import ROOT

BENCH = ROOT / "bench"
BENCHES = sorted(p.name for p in BENCH.glob("*.py") if p.name != "benchlib.py")
TRL = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                         reason="TRL is not installed (the bench extra: pip install -e '.[bench]')")

Table = tuple[list[str], list[list[str]]]


def bench(name: str, *args: str, store: Path | None = None, env: dict[str, str] | None = None,
          timeout: int = 540) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            **({"FINETUNE_STORE": str(store)} if store else {}), **(env or {})}
    with subprocess.Popen([sys.executable, str(BENCH / name), *args], cwd=ROOT, env=full, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # the servers and workers a bench starts in sessions of their own would outlive it, burning CPU
            # through the rest of the suite
            tree = psutil.Process(proc.pid)
            victims = [*tree.children(recursive=True), tree]
            for p in victims:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(victims, timeout=30)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def smoke(name: str, tmp_path: Path, *args: str, store: Path | None = None, env: dict[str, str] | None = None) -> str:
    """The bench's --smoke run on a fresh store (or `store`), `env` added to its environment: its stdout, after
    checking it ended well."""
    p = bench(name, "--smoke", *args, store=store or tmp_path / "store", env=env)
    assert p.returncode == 0, f"{name} --smoke: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return p.stdout


def tables(out: str) -> list[Table]:
    """The markdown tables in `out`: (header cells, rows of cells); each row has the header's width."""
    found, lines = [], out.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()) and \
                (i == 0 or not lines[i - 1].startswith("|")):
            head = cells(line)
            rows = []
            for r in lines[i + 2:]:
                if not r.startswith("|"):
                    break
                rows.append(cells(r))
                assert len(rows[-1]) == len(head), f"a row of {len(rows[-1])} cells under {len(head)}: {r}"
            found.append((head, rows))
    return found


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table(out: str, first: str) -> Table:
    """The table whose first header cell starts with `first`."""
    match = [t for t in tables(out) if t[0][0].startswith(first)]
    assert match, f"no table headed {first!r} in:\n{out[-3000:]}"
    return match[0]


def number(cell: str) -> float:
    """A cell's figure: '1,234', '0.52 s', '1.10x', '4.0%', '3/8' (-> 3)."""
    m = re.match(r"[-+]?[\d,]*\.?\d+(?:e[-+]?\d+)?", cell.replace(" ", ""))
    assert m, f"not a number: {cell!r}"
    return float(m.group().replace(",", ""))


def column(t: Table, name: str) -> list[str]:
    return [r[t[0].index(name)] for r in t[1]]


def labels(t: Table) -> list[str]:
    return [r[0] for r in t[1]]
