"""The architecture holds: import-linter's contracts (pyproject.toml) pass — layers flows -> stage graph
and CLI -> stage bodies -> shared helpers -> engine, stage bodies independent, no import cycles — and no
module outgrows one screenful of concerns."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

MAX_LINES = 420  # "about 400": a screenful of concerns, not a hard byte budget


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "5 kept, 0 broken" in proc.stdout


def test_no_module_over_about_400_lines():
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines())
             for pkg in ("stages", "flows") for p in (ROOT / pkg).rglob("*.py")}
    assert not {str(p): n for p, n in sizes.items() if n > MAX_LINES}
