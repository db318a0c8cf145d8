"""A store this process cannot write (a read-only folder here, a missing bucket on S3: tests/engine/
test_store_s3.py) is refused in one line before anything runs, unless the run needs no write: a fully cached
run reads it and writes nothing there. `inspect gc --force` there is one line too."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, needs_shared_data, run, subprocess_env

pytestmark = needs_shared_data
SETS = ("data.subset={train: 16, validation: 8, test: 8}",)
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


def without_root_override() -> None:
    """In the child, before it starts: root loses the right to write where permissions say no (CAP_DAC_*),
    so a folder without write permission is read-only to it as to any user."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def cli(store: Path, *args: str) -> subprocess.CompletedProcess:
    env = subprocess_env(store)
    env.pop("PREFECT_API_URL", None)
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, preexec_fn=without_root_override)


def chmod_tree(root: Path, writable: bool) -> None:
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode | 0o200 if writable else mode & ~0o222)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_a_read_only_store_serves_a_fully_cached_run_and_refuses_one_that_computes_before_prefect_starts(store_dir):
    """As root too: the child loses root's override of permissions, so the folder is read-only to it."""
    run("tiny-imdb", *SETS, until="tokenize")
    chmod_tree(store_dir, writable=False)
    before = snapshot(store_dir)
    try:
        cached = cli(store_dir, "stages", "tiny-imdb", "--until", "tokenize", "--set", SETS[0])
        cached_flow = cli(store_dir, "flows.finetune", "tiny-imdb", "--until", "tokenize", "--set", SETS[0])
        computes = cli(store_dir, "flows.finetune", "tiny-imdb", "--until", "model", "--set", SETS[0])
        gc = cli(store_dir, "flows.inspect", "gc", "--force")
        dry_gc = cli(store_dir, "flows.inspect", "gc")
    finally:
        chmod_tree(store_dir, writable=True)
    out = cached.stdout + cached.stderr
    assert cached.returncode == 0, out[-3000:]
    assert [line.split()[:2] for line in cached.stdout.splitlines() if line.startswith("  ")] == \
        [["data", "cached"], ["tokenize", "cached"]]
    assert f"store {store_dir} cannot be written ({store_dir} is not writable by this user); every stage is " \
        "cached, so this run only reads it" in out
    flow_out = cached_flow.stdout + cached_flow.stderr
    assert cached_flow.returncode == 0 and "Traceback" not in flow_out, flow_out[-3000:]
    assert "Finished in state Cached('store hit" in flow_out and f"store: {store_dir}" in cached_flow.stdout
    assert computes.returncode == 2 and computes.stdout == "", computes.stdout + computes.stderr
    assert computes.stderr == (
        f"error: the store {store_dir} cannot be written: {store_dir} is not writable by this user; stage model "
        f"must be computed (not in store) and cannot be committed there. Make it writable (or create its bucket), "
        f"or set FINETUNE_STORE to a store you can write (a store that cannot be written serves fully cached runs "
        f"only)\n")  # one line, before Prefect started (no temporary server)
    assert gc.returncode == 2 and gc.stderr == (
        f"error: inspect gc --force: the store {store_dir} cannot be written: {store_dir} is not writable by this "
        f"user; nothing was removed. Run it as a user who can write the store\n"), gc.stdout + gc.stderr
    assert dry_gc.returncode == 0, dry_gc.stdout + dry_gc.stderr  # a dry run only reads
    assert snapshot(store_dir) == before  # nothing written: no event, ref, run record, lock or registration
