"""`finetune methods`: the training methods (stages/methods/), what each learns, the head it trains and the
pipelines of pipeline.yaml (or --config FILE) that use it - torchtune's `tune ls`."""

from __future__ import annotations

import argparse

from flows.reports.formatting import render_table
from stages.engine.config import DEFAULT_PIPELINE_FILE, pipeline_names
from stages.engine.errors import FinetuneError
from stages.methods import BUILTIN, method_of
from stages.pipeline.loading import load_pipeline


def examples(path: str) -> dict[str, list[str]]:
    """{method name: the pipelines of the file that use it}."""
    out: dict[str, list[str]] = {}
    for name in pipeline_names(path):
        try:
            method = load_pipeline(name, [], path=path).method.name
        except FinetuneError:  # a pipeline that does not load is `finetune run`'s to report
            continue
        out.setdefault(method, []).append(name)
    return out


def main(argv: list[str] | None = None, *, prog: str = "finetune methods") -> int:
    p = argparse.ArgumentParser(prog=prog, description="The training methods: what each learns, the head it "
                                "trains, and the pipelines that use it.")
    p.add_argument("--config", default=str(DEFAULT_PIPELINE_FILE), help="the pipeline file whose pipelines are "
                   "listed as examples (default: the project's pipeline.yaml)")
    args = p.parse_args(argv)
    used = examples(args.config)
    rows = [[name, method_of(name).head.name, method_of(name).summary, ", ".join(used.pop(name, [])) or "-"]
            for name in BUILTIN]
    rows += [[name, method_of(name).head.name, method_of(name).summary, ", ".join(pipes)]
             for name, pipes in sorted(used.items())]  # a user's own, named by a pipeline of the file
    print(render_table([["method", "head", "what it learns", "example pipelines"], *rows]))
    print("\nA pipeline names its method at the top: `method: sft`, or `method: {name: sft, ...its settings}`; "
          "your own is `method: path/to/file.py:CLASS` (docs/methods.md).")
    return 0
