"""The pipeline-level memory estimate runs before the model stage computes and stops the run there."""

from __future__ import annotations

import pytest
from helpers import computed, needs_shared_data, run

from stages import memory
from stages.errors import ConfigError

pytestmark = needs_shared_data
SMALL = ("data.subset={train: 16, validation: 4, test: 4}",)


def test_training_that_cannot_fit_stops_before_loading(store_dir, monkeypatch):
    real_free_memory = memory.free_memory
    monkeypatch.setattr(memory, "free_memory", lambda: (1 << 20, "a 1 MiB test device"))
    with pytest.raises(ConfigError) as exc:
        run("tiny-imdb", *SMALL, until="model")
    msg = str(exc.value)
    assert "pipeline tiny-imdb: estimated" in msg and "a 1 MiB test device" in msg and "accumulation" in msg
    assert not (store_dir / "model").exists()
    # with room, the same run goes through; once cached, no estimate is needed
    monkeypatch.setattr(memory, "free_memory", real_free_memory)
    assert "model" in computed(run("tiny-imdb", *SMALL, until="model"))
    monkeypatch.setattr(memory, "free_memory", lambda: (1 << 20, "a 1 MiB test device"))
    assert computed(run("tiny-imdb", *SMALL, until="model")) == set()  # a hit never estimates
