"""Hub access: a repo already in the Hugging Face cache is usable offline; otherwise a fast, clear error."""

from __future__ import annotations

import time

import huggingface_hub.constants
import pytest

from stages.common.hub import ensure_hub_reachable
from stages.engine.errors import HubUnreachableError


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    snap = tmp_path / "models--org--tiny" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


def test_cached_repo_is_usable_offline_and_named_when_the_hub_is_down(hf_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ensure_hub_reachable("model org/tiny", "fix", "org/tiny")  # in the cache: no error
    with pytest.raises(HubUnreachableError, match="model org/other: the hub is off"):
        ensure_hub_reachable("model org/other", "fix", "org/other")
    monkeypatch.setenv("HF_HUB_OFFLINE", "")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a closed loopback port
    t0 = time.monotonic()
    with pytest.raises(HubUnreachableError, match="a copy is in the Hugging Face cache: set HF_HUB_OFFLINE=1"):
        ensure_hub_reachable("model org/tiny", "fix", "org/tiny")
    assert time.monotonic() - t0 < 1.5
