"""Unknown stage names in --force / --only / --until are refused by run_pipeline itself (the plain runner and
the Prefect flow both go through it), with one line naming the stages, before anything runs."""

from __future__ import annotations

import pytest

from stages.engine.config import load_pipeline
from stages.engine.errors import ConfigError
from stages.engine.store import Store
from stages.graph import run_pipeline, stage_names


@pytest.mark.parametrize("option,kw", [("--until", {"until": "trian"}), ("--only", {"only": "trian"}),
                                       ("--force", {"force": ["trian"]})])
def test_unknown_stage_name_is_refused_in_one_line(tmp_path, option, kw):
    cfg = load_pipeline("tiny-imdb", [])
    with pytest.raises(ConfigError) as e:
        run_pipeline(cfg, Store(tmp_path / "store"), **kw, run=lambda *a, **k: pytest.fail("a stage ran"))
    assert str(e.value) == f"{option} trian: unknown stage; stages are {', '.join(stage_names())}"
    assert "\n" not in str(e.value)
    assert not (tmp_path / "store").exists()
