"""Unknown stage names in --force / --only / --until are refused by run_pipeline itself (the plain runner and
the Prefect flow both go through it), with one line naming the stages, before anything runs."""

from __future__ import annotations

import pytest

from stages.engine.errors import ConfigError
from stages.engine.store import Store
from stages.graph import GRAPH
from stages.pipeline.loading import load_pipeline


@pytest.mark.parametrize("option,kw", [("--until", {"until": "trian"}), ("--only", {"only": "trian"}),
                                       ("--force", {"force": ["trian"]})])
def test_unknown_stage_name_is_refused_in_one_line(tmp_path, option, kw):
    cfg = load_pipeline("tiny-imdb", [])
    with pytest.raises(ConfigError) as e:
        GRAPH.plan(cfg, Store(tmp_path / "store"), **kw)
    assert str(e.value) == f"{option} trian: unknown stage (did you mean train?); stages are {', '.join(GRAPH.names)}"
    assert "\n" not in str(e.value)
    assert not (tmp_path / "store").exists()
