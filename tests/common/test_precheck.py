"""The pipeline-level memory estimate runs before the model stage computes and stops the run there."""

from __future__ import annotations

from types import SimpleNamespace

import psutil
import pytest
from helpers import computed, needs_shared_data, run

from stages.engine.errors import ConfigError

pytestmark = needs_shared_data
SMALL = ("data.subset={train: 16, validation: 4, test: 4}",)


def test_training_that_cannot_fit_stops_before_loading(store_dir, monkeypatch):
    real = psutil.virtual_memory
    tiny = lambda: SimpleNamespace(available=1_000_000)  # noqa: E731  (1 MB of free RAM)
    monkeypatch.setattr(psutil, "virtual_memory", tiny)
    with pytest.raises(ConfigError) as exc:
        run("tiny-imdb", *SMALL, until="model")
    msg = str(exc.value)
    assert "pipeline tiny-imdb: estimated" in msg and "CPU RAM has 1.00 MB free" in msg and "accumulation" in msg
    assert not (store_dir / "model").exists()
    # with room, the same run goes through; once cached, no estimate is made
    monkeypatch.setattr(psutil, "virtual_memory", real)
    assert "model" in computed(run("tiny-imdb", *SMALL, until="model"))
    monkeypatch.setattr(psutil, "virtual_memory", tiny)
    assert computed(run("tiny-imdb", *SMALL, until="model")) == set()


def test_memory_check_false_skips_the_estimate(store_dir, monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=1 << 20))  # 1 MiB free
    assert "model" in computed(run("tiny-imdb", *SMALL, "model.memory_check=false", until="model"))
