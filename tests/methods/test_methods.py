"""The method registry (stages/methods/): what differs between ways of training lives in one module per method,
the stages and the loop hold no method branch, and a pipeline file of before methods keeps loading."""

from __future__ import annotations

import logging
import re

import pytest
from helpers import ROOT

from stages.engine.errors import ConfigError
from stages.methods import BUILTIN, method_of
from stages.pipeline.loading import load_pipeline
from stages.pipeline.schema import LEGACY_TASKS, METHOD_SETTINGS, PipelineConfig

BRANCH = re.compile(r"""\bmethod\.name\s*(==|!=|in\b|not\s+in\b)|isinstance\([^)]*,\s*(Classify|Seq2Seq|SFT)\b""")


def test_no_module_outside_the_methods_branches_on_the_method():
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for pkg in ("stages", "flows") for p in sorted((ROOT / pkg).rglob("*.py"))
             if "methods" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if BRANCH.search(line)]
    assert not found, "a method branch outside stages/methods/: move it into the method\n" + "\n".join(found)


def test_the_registry_holds_the_builtin_methods_each_on_a_real_head():
    import peft
    import transformers

    assert set(BUILTIN) == set(METHOD_SETTINGS) == {"classify", "seq2seq", "sft"}
    for name in BUILTIN:
        method = method_of(name)
        assert method.name == name and method.predicts in ("labels", "texts") and method.summary
        head = method.head
        assert hasattr(transformers, head.auto_class) and hasattr(peft, head.auto_peft_class)
        assert peft.TaskType[head.peft_task_type]
        assert method.validation_metrics[0] == "loss"
        assert head.generates != head.classifies  # a head predicts classes or generates text
    with pytest.raises(ConfigError, match=r"^method: 'clasify' is not a method; use one of classify, seq2seq, sft"):
        method_of("clasify")


def test_a_pipeline_names_its_method_with_its_settings_and_a_wrong_one_is_one_line():
    cfg = PipelineConfig.model_validate({"name": "p", "method": "sft", "model": {"name": "m"}})
    assert cfg.method.name == "sft" and type(cfg.method).head == "causal_lm"
    assert PipelineConfig.model_validate({"name": "p", "method": {"name": "seq2seq"}, "model": {"name": "m"}}
                                         ).method.name == "seq2seq"
    with pytest.raises(ConfigError) as err:
        load_pipeline("demo", ["method=clasify"])
    assert str(err.value).startswith("--set method: 'clasify' is not a method; use one of classify, seq2seq, sft")
    with pytest.raises(ConfigError, match="method.beta"):
        load_pipeline("demo", ["method={name: classify, beta: 0.1}"])  # a setting classify does not have


def test_a_pipeline_of_before_methods_loads_with_one_line_giving_the_new_spelling(tmp_path, caplog):
    from stages.pipeline import schema

    file = tmp_path / "old.yaml"
    file.write_text("pipelines:\n  old:\n    model: {name: m, task: causal_lm, num_labels: null}\n")
    schema._told.discard("causal_lm")
    with caplog.at_level(logging.WARNING, logger="finetune.config"):
        cfg = load_pipeline("old", [], path=file)
    assert cfg.method.name == "sft" == LEGACY_TASKS["causal_lm"]
    said = [r.getMessage() for r in caplog.records if r.name == "finetune.config"]
    assert said == ["model.task: causal_lm is spelled `method: sft` now (top level of the pipeline); loaded as that"]
    with pytest.raises(ConfigError, match="model.task: 'regression' is not one of seq_cls, seq2seq, causal_lm"):
        load_pipeline("old", ["model.task=regression"], path=file)
