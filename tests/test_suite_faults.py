"""A test whose process dies (a native crash: SIGILL, SIGSEGV) fails, and the suite goes on and ends: a throwaway
pytest run with the project's scheduling (`-n 2 --dist loadfile --no-loadscope-reorder`, pyproject.toml, and
tests/crashsafe_scheduling.py) over files that crash their worker. Before it, xdist reran the crashed test on the
replacement worker and then waited for ever (`make test` hung until CI's limit)."""

from __future__ import annotations

import subprocess
import sys
import time

from helpers import ROOT

CRASHES = {
    "test_a.py": "import os, signal\n\ndef test_ill():\n    os.kill(os.getpid(), signal.SIGILL)\n\n"
                 "def test_after_the_crash():\n    pass\n",
    "test_b.py": "import time\n\ndef test_b1():\n    time.sleep(0.5)\n\ndef test_b2():\n    time.sleep(0.5)\n",
    "test_c.py": "import ctypes\n\ndef test_segv():\n    ctypes.string_at(0)\n",  # a real segfault, the last file
}


def test_a_worker_that_dies_fails_its_test_and_the_run_ends(tmp_path):
    for name, body in CRASHES.items():
        (tmp_path / name).write_text(body)
    (tmp_path / "conftest.py").write_text("from crashsafe_scheduling import pytest_xdist_make_scheduler  # noqa\n")
    env = {"PYTHONPATH": str(ROOT / "tests"), "PATH": "/usr/bin:/bin"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf", "-n", "2",
                           "--dist", "loadfile", "--no-loadscope-reorder", "-o", "addopts=", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    took = time.monotonic() - start
    out = done.stdout
    assert done.returncode == 1, out[-3000:]
    assert "2 failed, 3 passed" in out, out[-3000:]
    assert "crashed while running 'test_a.py::test_ill'" in out and "crashed while running 'test_c.py::test_segv'" in out
    assert took < 120, took
