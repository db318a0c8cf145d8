"""The architecture holds: import-linter's contracts (pyproject.toml) pass — layers flows -> stage graph
and CLI -> stage bodies -> shared helpers -> engine, stage bodies independent, no import cycles. (No test
counts a module's lines: modules are split by what they hold, not by length.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "6 kept, 0 broken" in proc.stdout


def test_planning_imports_no_torch_transformers_or_pandas():
    """The graph names the stage bodies without importing them (runner.Lazy), and `auto` precision is
    resolved from the CPU's flags: planning, all a run whose every stage is a store hit does before its
    hits, imports none of the libraries the bodies compute with (on a machine without a GPU driver: with
    one, torch is asked whether it sees the GPU)."""
    from stages.models.precision import GPU_NODES

    if any(os.path.exists(p) for p in GPU_NODES):
        pytest.skip("a GPU driver is present: planning asks torch about the GPU")
    code = ("import sys; from stages.pipeline.loading import load_pipeline; from stages.graph import GRAPH; "
            "items = GRAPH.plan(load_pipeline('tiny-imdb', [])).items; "
            "print(items[4].key.params['train']['mixed_precision'], "
            "sorted(m for m in ('torch', 'transformers', 'peft', 'accelerate', 'datasets', 'pandas', 'pyarrow', "
            "'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "FINETUNE_CPU_BF16_UNITS": "avx512_bf16"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["bf16", "[]"]


def test_every_project_name_a_bench_script_imports_exists():
    """bench/ scripts run by hand, not in the suite: a rename in stages/ or flows/ must not leave one failing
    at its first line (the module and each name it takes from it, read from the source, nothing run)."""
    import ast
    import importlib

    missing = []
    for script in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("stages", "flows"):
                try:
                    module = importlib.import_module(node.module)
                except ImportError as e:
                    missing.append(f"{script.name}: {node.module} ({e})")
                    continue
                missing += [f"{script.name}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    assert not missing, missing
