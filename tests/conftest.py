"""Test-session defaults: offline, the real data mirror, a fresh store per test, tiny models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"

# Never touch the network from tests: the hub fails at once instead of retrying for a minute.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("FINETUNE_DATA_MIRROR", str(SHARED_DATA))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

needs_shared_data = pytest.mark.skipif(not (SHARED_DATA / "imdb" / "train.csv.gz").exists(),
                                       reason="../shared/data (real IMDB/billsum) is not beside the project")


@pytest.fixture
def store_dir(tmp_path, monkeypatch) -> Path:
    """A fresh artifact store for this test (FINETUNE_STORE points at it)."""
    root = tmp_path / "store"
    monkeypatch.setenv("FINETUNE_STORE", str(root))
    return root
