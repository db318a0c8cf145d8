"""The schema is the one home of what a config field means: every field describes itself, and
docs/configuration.md's configuration reference is the schema rendered (stages/pipeline/reference.py)."""

from __future__ import annotations

import inspect
import typing

from pydantic import BaseModel

from stages.pipeline import reference, schema

REFRESH = "python -m stages.pipeline.reference --write"


def schema_models() -> list[type[BaseModel]]:
    return [m for m in vars(schema).values()
            if inspect.isclass(m) and issubclass(m, BaseModel) and m.__module__ == schema.__name__]


def test_every_field_of_every_section_has_a_description():
    models = schema_models()
    assert {schema.PipelineConfig.model_fields[s].annotation for s in schema.SECTIONS} <= set(models)
    missing = [f"{m.__name__}.{name}" for m in models for name, f in m.model_fields.items()
               if not (f.description or "").strip()]
    assert not missing, f"fields without description= in stages/pipeline/schema.py: {missing}"


def test_the_readme_reference_is_the_generated_one():
    text = reference.REFERENCE_DOC.read_text()
    block = reference.current(text)
    assert block is not None, f"docs/configuration.md lacks the {reference.START} ... {reference.END} markers"
    assert block == reference.render(), f"docs/configuration.md's configuration reference is stale: run `{REFRESH}`"


def test_every_field_has_one_row_that_says_whether_it_is_in_the_key():
    rendered = reference.render()
    rows = {line.split(" | ")[0].strip("| `"): line.split(" | ") for line in rendered.splitlines()
            if line.startswith("| `")}
    for section in schema.SECTIONS:
        cfg = schema.PipelineConfig.model_fields[section].annotation
        required = {n: None for n, f in cfg.model_fields.items() if f.is_required()}
        keyed = set(cfg.model_construct(**required).cache_dict())
        for name in cfg.model_fields:
            row = rows.pop(f"{section}.{name}")
            assert row[3] == ("key" if name in keyed else "runtime"), (section, name, row[3])
    top = set(schema.PipelineConfig.model_fields) - set(schema.SECTIONS)
    assert top <= set(rows)  # the rest: top-level fields and nested fields (data.split.*)


def test_choices_bounds_and_defaults_are_rendered_from_the_annotation():
    row = next(line for line in reference.render().splitlines() if line.startswith("| `train.optimizer` |"))
    choices = typing.get_args(schema.TrainConfig.model_fields["optimizer"].annotation)
    assert row.split(" | ")[1] == " \\| ".join(f"`{c}`" for c in choices)
    assert row.split(" | ")[2] == '`"adamw_torch"`'
    row = next(line for line in reference.render().splitlines() if line.startswith("| `train.max_grad_norm` |"))
    assert row.split(" | ")[1:3] == ["float or null (> 0)", "`null`"]


def test_write_refreshes_a_stale_block_and_keeps_the_rest(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# before\n\n{reference.START}\nold table\n{reference.END}\n\n## after\n")
    assert reference.write(readme) is True
    text = readme.read_text()
    assert text == f"# before\n\n{reference.render()}\n\n## after\n"
    assert reference.write(readme) is False
