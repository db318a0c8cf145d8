"""kill -9 during stage writes, two concurrent runs, and editing a helper a stage calls: all through real
subprocesses of `python -m stages` on a real IMDB slice."""

from __future__ import annotations

import random
import shutil
import signal
import time

import pytest
from helpers import ROOT, SHARED_DATA, needs_shared_data, spawn

from stages.engine.store import Store

pytestmark = needs_shared_data
ARGS = ["tiny-imdb", "--until", "tokenize", "--set", "data.subset={train: 2000, validation: 200, test: 200}"]


def wait_for_line(proc, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        if text in line:
            return
        assert time.monotonic() < deadline, f"no '{text}' within {timeout}s"
    raise AssertionError(f"process ended before printing '{text}'")


def assert_no_partial_artifact_is_cached(store: Store) -> None:
    for stage, key, folder in store.entries():
        # anything under <stage>/<key> was renamed into place whole: it must verify in full
        assert store.problems(stage, key, verify=True) == [], f"partial artifact visible: {folder}"


def test_kill_9_at_random_points_never_leaves_a_cached_partial(tmp_path):
    store_root = tmp_path / "store"
    proc = spawn(ARGS, store_root)
    t0 = time.monotonic()
    wait_for_line(proc, "-> store")
    t_start = time.monotonic() - t0
    out, _ = proc.communicate(timeout=300)
    full = time.monotonic() - t0 - t_start
    assert proc.returncode == 0, out
    rng = random.Random(1234)
    store = Store(store_root)
    kill_points = []
    for trial in range(4):  # each of: from an empty store or --force, a path or a file:// URL
        # alternate: recompute everything in place (--force) or from an empty store
        if trial % 2:
            shutil.rmtree(store_root, ignore_errors=True)
            extra = []
        else:
            extra = ["--force", "data", "--force", "tokenize"]
        # every other trial addresses the store as a file:// URL (the shared-store form)
        proc = spawn(ARGS + extra, f"file://{store_root}" if trial % 4 in (2, 3) else store_root)
        wait_for_line(proc, "-> store")
        delay = rng.uniform(0.05, full * 0.95)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        kill_points.append(round(delay, 2))
        assert_no_partial_artifact_is_cached(store)
    proc = spawn(ARGS, store_root)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert store.verify_all(full=True) == {}
    assert {s for s, _, _ in store.entries()} == {"data", "tokenize"}
    assert list(store_root.glob(".tmp/*")) == []  # the killed runs' half-written folders are gone too
    print("kill points (s after start):", kill_points)


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_two_concurrent_runs_compute_each_stage_once(tmp_path, scheme):
    store_root = tmp_path / "store"
    procs = [spawn(ARGS, f"{scheme}{store_root}") for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    events = Store(store_root).events()
    for stage in ("data", "tokenize"):
        kinds = sorted(e["event"] for e in events if e["stage"] == stage)
        assert kinds == ["cached", "computed"], (stage, kinds)
    assert len({e["pid"] for e in events}) == 2
    assert Store(store_root).verify_all(full=True) == {}


def test_editing_a_helper_reruns_the_stage_that_calls_it(tmp_path):
    # A copy of the project, so the edit happens to real source files.
    proj = tmp_path / "proj"
    shutil.copytree(ROOT / "stages", proj / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pipeline.yaml", proj / "pipeline.yaml")
    store_root = tmp_path / "store"
    small = ["tiny-imdb", "--until", "tokenize", "--set", "data.subset={train: 40, validation: 8, test: 8}"]

    def run_copy() -> list[dict]:
        before = len(Store(store_root).events())
        proc = spawn(small, store_root, cwd=proj, FINETUNE_DATA_MIRROR=str(SHARED_DATA))
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        assert f"{proj}" in out  # the copy ran, not the installed project
        return Store(store_root).events()[before:]

    def computed(events: list[dict]) -> set[str]:
        return {e["stage"] for e in events if e["event"] == "computed"}

    assert computed(run_copy()) == {"data", "tokenize"}
    assert computed(run_copy()) == set()
    # special_affixes is a helper of the tokenize stage, in the shared helpers
    src = proj / "stages" / "models" / "hf.py"
    text = src.read_text()
    assert "for i in range(len(full))" in text
    src.write_text(text.replace("for i in range(len(full))", "for i in range(0, len(full))"))
    assert computed(run_copy()) == {"tokenize"}
    # split_gguf lives in another module (stages/models/hf.py) and is reached through load_tokenizer
    hf = proj / "stages" / "models" / "hf.py"
    hf.write_text(hf.read_text().replace('"""(what to pass to from_pretrained, extra kwargs, local path or None',
                                         '"""(what to hand to from_pretrained, extra kwargs, local path or None'))
    assert computed(run_copy()) == {"tokenize"}
    # a helper of the data stage in another module
    data = proj / "stages" / "data.py"
    data.write_text(data.read_text().replace("perm = df.sample(frac=1, random_state=seed)",
                                             "perm = df.sample(frac=1.0, random_state=seed)"))
    events = run_copy()
    assert computed(events) == {"data", "tokenize"}  # downstream keys include upstream keys
