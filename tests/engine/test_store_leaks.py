"""No leaks in the store's .tmp: what dead runs left (a half-written output, a trash or gc folder cut short)
is swept by the next run on that store and listed and removed by `inspect gc`; a live writer's folder is never
touched; a failed manifest write removes its own temporary folder."""

from __future__ import annotations

import re

import helpers
import pytest
from helpers import needs_shared_data

from flows.reports.inspect_cli import main as inspect_main
from stages.engine.errors import DiskFullError
from stages.engine.store import Store

pytestmark = needs_shared_data
SMALL = ("data.subset={train: 40, validation: 8, test: 8}",)
DEAD_KEY, LIVE_KEY = "a" * 64, "b" * 64


def litter(store: Store) -> dict[str, object]:
    tmp = store.root / ".tmp"
    out = {}
    for name in (f"train-{DEAD_KEY}-4242-0badc0de", f"tokenize-{LIVE_KEY}-4343-0badc0de",
                 f"trash-{'c' * 64}-1234abcd", f"gc-train-{'d' * 12}-1234abcd"):
        (tmp / name / "sub").mkdir(parents=True)
        (tmp / name / "sub" / "weights.bin").write_bytes(bytes(1000))
        out[name] = tmp / name
    return out


def test_the_next_run_sweeps_dead_runs_tmp_and_spares_a_live_writer(store_dir):
    store = Store(store_dir)
    folders = litter(store)
    with store.try_lock(LIVE_KEY) as held:  # a run writing tokenize/LIVE_KEY right now
        assert held
        helpers.run("tiny-imdb", *SMALL, until="data")
        left = sorted(p.name for p in (store_dir / ".tmp").iterdir())
    assert left == [f"tokenize-{LIVE_KEY}-4343-0badc0de"], left
    assert folders[left[0]].is_dir()


def test_gc_lists_dead_tmp_and_removes_it_with_force(store_dir, capsys):
    helpers.run("tiny-imdb", until="data")  # reachable: gc keeps it
    store = Store(store_dir)
    litter(store)
    with store.try_lock(LIVE_KEY):
        assert inspect_main(["gc"]) == 0
        out = capsys.readouterr().out
        assert out.count("a dead run's temporary folder") == 3 and LIVE_KEY[:12] not in out, out
        assert inspect_main(["gc", "--force", "--min-age", "0"]) == 0
        out = capsys.readouterr().out
    assert sorted(p.name for p in (store_dir / ".tmp").iterdir()) == [f"tokenize-{LIVE_KEY}-4343-0badc0de"]
    assert "removed 3 of 3" in out, out


def test_a_failed_manifest_write_leaves_no_tmp_folder(store_dir, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Store, "_write_manifest", disk_full)
    with pytest.raises(DiskFullError, match=r"^stage data: the disk is full \(OSError: \[Errno 28\] No space left on "
                       r"device\); .* free in the store .*; no artifact is half-written"):
        helpers.run("tiny-imdb", *SMALL, until="data")
    assert list((store_dir / ".tmp").iterdir()) == []
    assert not list(Store(store_dir).entries())


def test_a_file_the_disk_cannot_take_is_one_line_exit_2_and_the_rerun_computes_from_that_stage(store_dir, capsys):
    """A real write error, not a patched one: the file-size limit (RLIMIT_FSIZE, what a full disk or quota does
    to a writer: the write fails, EFBIG instead of ENOSPC) lets the small data and tokenize artifacts through
    and stops the model stage's 4 MB safetensors file. The command line says so in one line, exit 2; nothing
    of the model stage is left in the store or its .tmp; with room again, the rerun computes from that stage."""
    import resource
    import signal

    from stages.__main__ import main as main_plain

    assert main_plain(["tiny-imdb", *(f"--set={s}" for s in SMALL), "--until", "tokenize"]) == 0
    capsys.readouterr()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, hard))
    try:
        code = main_plain(["tiny-imdb", *(f"--set={s}" for s in SMALL)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: stage model: the disk is full (") \
        and "File too large" in err[0] and "free in the store" in err[0], err
    assert list((store_dir / ".tmp").iterdir()) == [] and not (store_dir / "model").exists()
    assert main_plain(["tiny-imdb", *(f"--set={s}" for s in SMALL)]) == 0
    done = re.findall(r"^\s+(\w+)\s+(computed|cached)", capsys.readouterr().out, re.M)
    assert done == [("data", "cached"), ("tokenize", "cached"), ("model", "computed"), ("adapters", "computed"),
                    ("train", "computed"), ("evaluate", "computed"), ("export", "computed")], done
