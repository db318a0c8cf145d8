"""`pip install .` (not editable) ships everything: the wheel built from the checkout, installed into a fresh
venv outside it, runs tiny-imdb from a folder outside the repo (without Prefect, then as a Prefect flow), with
its store (artifacts/) and Prefect home (.prefect/) in that folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT, SHARED_DATA, needs_shared_data


def _sh(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _copy_checkout(dest: Path) -> None:
    """The working tree's files git would commit (tracked and untracked-not-ignored): no build/ leftovers."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    _copy_checkout(src)
    _sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(tmp / "dist"), str(src)], cwd=tmp)
    [whl] = (tmp / "dist").glob("finetune-*.whl")
    return whl


def test_wheel_carries_every_package_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for metric in ("accuracy/accuracy.py", "f1/f1.py", "rouge/rouge.py", "README.md"):
        assert f"stages/methods/metric_modules/{metric}" in names
    assert "stages/pipeline.yaml" in names
    shipped = zipfile.ZipFile(wheel).read("stages/pipeline.yaml")
    assert shipped == (ROOT / "pipeline.yaml").read_bytes()
    # every module of the checkout's packages is in the wheel
    sources = {p.relative_to(ROOT).as_posix() for pkg in ("stages", "flows") for p in (ROOT / pkg).rglob("*.py")
               if "__pycache__" not in p.parts}
    assert sources - names == set()
    assert not any(n.startswith("tests/") for n in names)


@needs_shared_data
def test_installed_wheel_runs_tiny_imdb_outside_the_repo(wheel, tmp_path):
    venv = tmp_path / "venv"
    # A fresh venv without the project; the shared venv's site-packages joins it through a plain path line
    # (a .pth path line adds the folder without running that folder's .pth files: the project's editable
    # finder there does not load), so the libraries are there but `stages` can only come from the wheel.
    _sh([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    purelib = Path(_sh([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                       cwd=tmp_path).stdout.strip())
    (purelib / "shared-libraries.pth").write_text(sysconfig.get_path("purelib") + "\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # a checkout on
    # PYTHONPATH shows pip its finetune.egg-info: "already satisfied", nothing installed
    _sh([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
         str(wheel)], cwd=tmp_path, env=clean)

    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "FINETUNE_STORE", "PREFECT_HOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", FINETUNE_DATA_MIRROR=str(SHARED_DATA), OMP_NUM_THREADS="1")

    where = json.loads(_sh([str(python), "-c", "import json, stages, flows, stages.engine.config as c; "
                            "print(json.dumps([stages.__file__, flows.__file__, str(c.DEFAULT_PIPELINE_FILE), "
                            "c.store_root()]))"], cwd=work, env=env).stdout)
    for path in where[:3]:
        assert Path(path).is_relative_to(purelib), f"{path} is not the installed wheel's"
    assert where[3] == str(work / "artifacts")

    run = _sh([str(python), "-m", "stages", "tiny-imdb"], cwd=work, env=env)
    assert f"({purelib / 'stages'}) -> store {work / 'artifacts'}" in run.stdout  # the code it ran, its store
    [metrics] = (work / "artifacts" / "evaluate").glob("*/metrics.json")
    test = json.loads(metrics.read_text())["test"]
    assert test["examples"] == 64 and 0.0 <= test["accuracy"] <= 1.0

    # the console script from the wheel reads the same store and finds every stage cached
    status = _sh([str(venv / "bin" / "finetune"), "inspect", "status", "tiny-imdb"], cwd=work, env=env)
    assert "7 of 7 stages cached" in status.stdout, status.stdout
    # keys come from sources, not build output: the .pyc files pip compiled into the wheel's metric modules
    # are in no key, so the checkout finds the wheel's artifacts cached, and so does a reinstall
    assert list((purelib / "stages").rglob("__pycache__/*.pyc"))
    checkout = _sh([sys.executable, "-m", "flows.inspect", "status", "tiny-imdb"], cwd=ROOT,
                   env={**env, "FINETUNE_STORE": str(work / "artifacts")})
    assert "7 of 7 stages cached" in checkout.stdout, checkout.stdout
    _sh([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
         "--force-reinstall", str(wheel)], cwd=tmp_path, env=clean)
    status = _sh([str(venv / "bin" / "finetune"), "inspect", "status", "tiny-imdb"], cwd=work, env=env)
    assert "7 of 7 stages cached" in status.stdout, status.stdout

    # and runs the Prefect flow on it (every stage a store hit), its Prefect home under the current directory
    flow = _sh([str(venv / "bin" / "finetune"), "run", "tiny-imdb"], cwd=work, env=env)
    out = flow.stdout + flow.stderr
    assert f"store: {work / 'artifacts'}" in out and " computed " not in out, out[-3000:]
    assert (work / ".prefect").is_dir()
