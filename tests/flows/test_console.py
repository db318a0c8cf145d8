"""The installed `finetune` command ([project.scripts] -> flows/console.py): its subcommands are the
`python -m flows.<module>` entry points, each with its own --help, and bad input is one line, exit 2."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from flows.console import COMMANDS, main

SCRIPT = Path(sys.executable).parent / "finetune"

pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="the project is not installed (pip install -e .)")


def finetune(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"PATH": f"{SCRIPT.parent}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "FINETUNE_STORE": str(tmp_path / "store"), "PREFECT_HOME": str(tmp_path / "prefect")}
    return subprocess.run([str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_help_lists_every_subcommand(tmp_path):
    res = finetune("--help", tmp_path=tmp_path)
    assert res.returncode == 0, res.stderr
    listed = [line.split()[0] for line in res.stdout.splitlines() if line.startswith("  ")]
    assert listed == ["run", "sweep", "serve", "inspect", "summary", "predict", "methods", "serve-model", "server"] == \
        list(COMMANDS)
    assert finetune(tmp_path=tmp_path).returncode == 2  # no command: the same help, exit 2


@pytest.mark.parametrize("command", ["run", "sweep", "serve", "inspect", "summary", "methods", "serve-model"])
def test_each_subcommand_has_its_own_help(capsys, command):  # in this process: the dispatch is the same
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: finetune {command} ")


def test_inspect_subcommands_run_from_the_console(tmp_path):
    res = finetune("inspect", "status", "tiny-imdb", tmp_path=tmp_path)
    assert res.returncode == 1, res.stderr  # nothing in the fresh store: every stage missing
    assert "tiny-imdb" in res.stdout and "missing" in res.stdout
    assert not (tmp_path / "prefect").exists()  # a report never starts Prefect


def test_bad_input_is_one_line_and_exit_2_before_prefect(tmp_path):
    res = finetune("run", "bloom-imdb", "--set", "train.gradient_accumulation_steps=0", tmp_path=tmp_path)
    assert (res.returncode, res.stderr.strip()) == (2, "error: --set train.gradient_accumulation_steps: must be "
                                                       ">= 1, got 0")
    assert not (tmp_path / "store").exists() and not (tmp_path / "prefect").exists()


def test_an_unknown_command_is_one_line(capsys):
    assert main(["trian"]) == 2
    assert capsys.readouterr().err.strip() == ("error: unknown command 'trian'; commands: run, sweep, serve, "
                                               "inspect, summary, predict, methods, serve-model, server (finetune --help)")


def test_predict_dispatches_or_says_it_is_missing(capsys):
    if (ROOT / "flows" / "predict.py").exists():
        with pytest.raises(SystemExit) as exit_:
            main(["predict", "--help"])
        assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out
    else:
        assert main(["predict"]) == 2
        assert capsys.readouterr().err.strip() == "error: finetune predict: this install has no flows.predict module yet"


@pytest.mark.parametrize("command", [[str(SCRIPT), "inspect", "runs"], [sys.executable, "-m", "flows.inspect", "runs"],
                                     [str(SCRIPT), "--help"]], ids=["finetune", "python -m flows.inspect", "help"])
def test_a_reader_that_left_early_is_no_traceback(tmp_path, command):
    """`finetune inspect runs | head`: the reader is gone before the command writes (a pipe whose read end is
    closed, as after `head` exits). Exit 1, nothing on stderr: no BrokenPipeError, no 'Exception ignored'."""
    env = {"PATH": f"{SCRIPT.parent}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "FINETUNE_STORE": str(tmp_path / "store"), "PREFECT_HOME": str(tmp_path / "prefect")}
    read, write = os.pipe()
    os.close(read)
    try:
        res = subprocess.run(command, cwd=ROOT, env=env, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert res.returncode == 1 and res.stderr == ""
    # and through a shell, piped to head
    shell = subprocess.run(["bash", "-c", f"{shlex.join(command)} | head -n 0; echo ${{PIPESTATUS[0]}}"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
    assert shell.stderr == "" and shell.stdout.strip() in ("0", "1")
