"""Names a user gives that become paths: a sweep's --name and a pipeline's name never leave the store
(pipeline names in a file: tests/engine/test_config.py's malformed-config cases)."""

from __future__ import annotations

import pytest

from flows.reports.variants import adhoc_sweep, sweep_dir
from stages.engine.errors import ConfigError
from stages.engine.names import inside, name_problem
from stages.engine.store import Store


@pytest.mark.parametrize("name", ["../x", "..", "a/b", "/etc/x", "a\\\\b", ".hidden", "", "x" * 129, "a..b", "é"])
def test_a_path_is_not_a_name(name):
    assert name_problem(name)


@pytest.mark.parametrize("name", ["bloom-imdb", "smol-chat-4bit", "tiny-imdb-3f2a9c1d", "lr=1e-3", "v1.2", "a_b+c"])
def test_names_people_use_are_names(name):
    assert name_problem(name) is None


def test_a_sweep_name_that_is_a_path_is_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(ConfigError, match=r"^--name: '\.\./\.\./x' is not a name: use "):
        adhoc_sweep("tiny-imdb", ["train.lr=1e-3,2e-3"], name="../../x")
    store = Store(tmp_path / "store")
    with pytest.raises(ConfigError, match="outside the store"):
        sweep_dir(store, "../../x")
    assert sweep_dir(store, "lrs") == tmp_path / "store" / "sweeps" / "lrs"


def test_the_store_writes_no_ref_outside_itself(tmp_path):
    victim = tmp_path / "victim.json"
    victim.write_text("precious")
    store = Store(tmp_path / "store")
    for name in ("../victim", str(tmp_path / "victim")):
        with pytest.raises(ConfigError, match="is not a name"):
            store.set_ref(name, "train", "k" * 64)
    assert victim.read_text() == "precious" and not (tmp_path / "store" / "refs").exists()
    with pytest.raises(ConfigError, match="outside the store"):
        inside(tmp_path / "store", tmp_path / "store" / ".." / "victim.json")
