"""Shared test utilities: run pipelines through the plain runner and read what the store did."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from stages.engine.plan import Graph, Planned
from stages.engine.remote_store import open_store
from stages.engine.runner import execute
from stages.engine.stage import Stage
from stages.engine.store import Outcome, Store
from stages.graph import GRAPH
from stages.pipeline.loading import load_pipeline
from stages.pipeline.schema import PipelineConfig

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
SHARED_FILES = ("imdb/train.csv.gz", "billsum/billsum_us_train_sample100.jsonl")  # what the skips look for


def shared_data_present() -> bool:
    return (SHARED_DATA / SHARED_FILES[0]).exists()


# (under CI=true a missing mirror fails the run instead: tests/conftest.py, pytest_configure)
needs_shared_data = pytest.mark.skipif(not shared_data_present(),
                                       reason="../shared/data (real IMDB/billsum) is not beside the project")

# The --set lists of tests/stages/test_evaluate.py and test_export.py: one definition, so the stages they
# share are store hits in the `store` fixture (tests/stages/conftest.py) whichever file runs first.
IMDB = ("data.subset={train: 32, validation: 8, test: 16}", "train.max_steps=2",
        "evaluate.splits=[validation, test]", "evaluate.batch_size=5")
BILLSUM = ("train.max_steps=2", "evaluate.max_new_tokens=8")


def as_graph(graph: Graph | Iterable[Stage]) -> Graph:
    return graph if isinstance(graph, Graph) else Graph(graph, GRAPH.project)


def run_pipeline(cfg: PipelineConfig, store: Store, graph: Graph | Iterable[Stage] = GRAPH,
                 **selection: Any) -> list[Outcome]:
    """What `python -m stages` does: plan the config (only/until/force/verify) and execute the plan."""
    g = as_graph(graph)
    return execute(g.plan(cfg, store, **selection), store)


def plan(cfg: PipelineConfig, store: Store | None = None, graph: Graph | Iterable[Stage] = GRAPH) -> list[Planned]:
    """Every stage of the config's plan, with its key."""
    return list(as_graph(graph).plan(cfg, store).items)


def run(pipeline: str, *sets: str, **kw) -> dict[str, Outcome]:
    cfg = load_pipeline(pipeline, list(sets))
    return {o.stage: o for o in run_pipeline(cfg, open_store(), **kw)}


def computed(outcomes: dict[str, Outcome]) -> set[str]:
    return {name for name, o in outcomes.items() if o.computed}


def subprocess_env(store: Path | str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"FINETUNE_STORE": str(store), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}, **extra)
    return env


def spawn(args: list[str], store: Path | str, cwd: Path = ROOT, **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stages", *args], cwd=cwd, env=subprocess_env(store, **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# A llama_cpp that is the installed binding, except that loading the file named by $CRASH_ON kills the process with
# $CRASH_SIGNAL: what llama.cpp's kernels do on a CPU that advertises an instruction its VM will not run (AMX).
FAULTY_LLAMA_CPP = """
import os, signal, sys
_here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules[__name__]
import llama_cpp as _real

class Llama(_real.Llama):
    def __init__(self, model_path, **kw):
        if os.path.basename(model_path) == os.environ["CRASH_ON"]:
            os.kill(os.getpid(), getattr(signal, os.environ["CRASH_SIGNAL"]))
        super().__init__(model_path=model_path, **kw)

_real.Llama = Llama
"""
