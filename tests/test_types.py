"""mypy over stages/ and flows/ (configured in pyproject.toml's [tool.mypy]) reports no error, so the types a
reader follows (ctx.cfg.train.lr -> TrainConfig.lr -> make_optimizer) are the ones the code uses. The first
run analyses torch and transformers (minutes); later runs reuse .mypy_cache (seconds)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1200)
def test_stages_and_flows_are_type_clean():
    r = subprocess.run([sys.executable, "-m", "mypy", "stages", "flows"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"mypy found type errors (fix them, do not ignore them wholesale):\n{r.stdout}{r.stderr}"
