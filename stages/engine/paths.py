"""Where the project's files are. A source checkout keeps its pipeline.yaml, artifacts/ and .prefect/ at its
top; an installed wheel (`pip install .`) carries pipeline.yaml inside the package and keeps artifacts/ and
.prefect/ in the current directory, since its own folder is site-packages. Imports nothing heavy: the
Prefect defaults read it before Prefect is imported."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

# The folder holding stages/ and flows/: the checkout's top, or site-packages for an installed wheel.
PROJECT_ROOT = Path(__file__).resolve().parents[2]
# The copy of pipeline.yaml the wheel carries (the build copies the checkout's top-level file there).
PACKAGED_PIPELINE_FILE = Path(__file__).resolve().parents[1] / "pipeline.yaml"


def _is_checkout(root: Path) -> bool:
    if (root / "pipeline.yaml").is_file() and not (root / "stages" / "pipeline.yaml").is_file():
        return True  # a copy of the source tree (the wheel carries stages/pipeline.yaml, a checkout never)
    try:
        return tomllib.loads((root / "pyproject.toml").read_text()).get("project", {}).get("name") == "finetune"
    except (OSError, tomllib.TOMLDecodeError):
        return False


SOURCE_CHECKOUT = _is_checkout(PROJECT_ROOT)
PIPELINE_FILE = PROJECT_ROOT / "pipeline.yaml" if SOURCE_CHECKOUT else PACKAGED_PIPELINE_FILE


def work_root() -> Path:
    """The folder relative state lives in (artifacts/, .prefect/): the checkout, else the current directory."""
    return PROJECT_ROOT if SOURCE_CHECKOUT else Path.cwd()


def cache_dir() -> Path:
    """This machine's cache ($FINETUNE_CACHE, default ~/.cache/finetune): local copies of a shared store's
    artifacts, GGUF files converted once. Never part of a key; deleting it costs downloads and conversions."""
    return Path(os.environ.get("FINETUNE_CACHE") or Path.home() / ".cache" / "finetune")


def why_missing(path: Path) -> str:
    """Why a path that does not exist is not there, in words: a symlink loop, a broken symlink, or none."""
    if path.is_symlink():
        try:
            path.resolve(strict=True)
        except RuntimeError:
            return "a symlink loop"
        except OSError:
            return f"a broken symlink (to {os.readlink(path)}, which does not exist)"
        return "a symlink"
    return "no such file or folder"
