"""What every bench shares: its command line with `--smoke` (the tiny size the suite runs:
tests/bench/), a missing optional dependency as one line naming its extra, and table rows printed
as they are measured, so a bench that dies keeps the rows before it.

Imported by the benches as a sibling module (`python bench/X.py` puts bench/ first on sys.path); it imports only
the standard library, so `--help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SMOKE_HELP = "the tiny size the test suite runs (seconds): every variant and table, a few rows"

# the extra (pyproject.toml [project.optional-dependencies]) that brings each optional module a bench imports
EXTRAS = {"trl": "bench", "onnx": "onnx", "onnxruntime": "onnx", "llama_cpp": "gguf", "convert_hf_to_gguf": "gguf",
          "mlflow": "mlflow", "s3fs": "s3", "moto": "dev"}


def parser(doc: str | None, **kw: Any) -> argparse.ArgumentParser:
    """The bench's argument parser: its docstring's first paragraph as the description, `--smoke` added."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0], **kw)
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    return p


def require(*modules: str) -> None:
    """Exit 2 with one line naming the extra to install when one of `modules` cannot be imported."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            extra = EXTRAS.get(name, "dev")
            print(f"{Path(sys.argv[0]).name}: needs {name} (the {extra} extra), which is not installed "
                  f"({type(e).__name__}: {e}); install it: pip install -e '.[{extra}]'", file=sys.stderr)
            raise SystemExit(2) from None


def row(cells: Iterable[object]) -> None:
    """One markdown table row (or header), printed at once."""
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def header(cells: list[str], align: str | None = None) -> None:
    """A markdown table's header and its rule (`align`: one of '-', ':' (right) per column, default: the first
    column left, the rest right)."""
    row(cells)
    marks = align or "-" + ":" * (len(cells) - 1)
    print("|" + "|".join("---:" if a == ":" else "---" for a in marks) + "|", flush=True)
