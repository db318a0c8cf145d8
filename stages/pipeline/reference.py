"""The configuration reference in docs/configuration.md, generated from the schema (stages/pipeline/schema.py): one markdown
table per pipeline.yaml section, one row per field (nested models such as `data.split` flattened).

    python -m stages.pipeline.reference           # print the block
    python -m stages.pipeline.reference --write   # refresh it in docs/configuration.md, between the markers
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, Literal

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from stages.pipeline.choices import one_of
from stages.pipeline.schema import SECTIONS, PipelineConfig, Section, SweepConfig, is_runtime

REFERENCE_DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
NOTE = "<!-- generated: edit the descriptions in stages/pipeline/schema.py, then `python -m stages.pipeline.reference --write` -->"
BOUNDS = ((at.Ge, "ge", "≥"), (at.Gt, "gt", ">"), (at.Le, "le", "≤"), (at.Lt, "lt", "<"))


def type_text(tp: Any) -> str:
    """`a` \\| `b` for Literals, `X or null` for optionals, `list of X`, `mapping X → Y`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if registry := one_of(tp):  # a registry's names, e.g. data.source
        return " \\| ".join(f"`{a}`" for a in registry.names())
    if origin is Annotated:
        return type_text(args[0])
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, UnionType):
        kinds = [type_text(a) for a in args if a is not NoneType]
        return " or ".join(kinds) + (" or null" if NoneType in args else "")
    if origin is list:
        return f"list of {type_text(args[0])}"
    if origin is dict:
        return f"mapping {type_text(args[0])} → {type_text(args[1])}"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def bounds_text(field: FieldInfo) -> str:
    parts = [f"{sign} {getattr(m, attr)}" for m in field.metadata for cls, attr, sign in BOUNDS if isinstance(m, cls)]
    parts += [f"at least {m.min_length} item(s)" for m in field.metadata if isinstance(m, at.MinLen)]
    return ", ".join(parts)


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(see below)"
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def rows(model: type[BaseModel], prefix: str) -> list[tuple[str, FieldInfo]]:
    """(dotted name, field) for every field, a nested Section's fields after the field that holds it."""
    out = []
    for name, field in model.model_fields.items():
        out.append((prefix + name, field))
        for nested in (field.annotation, *typing.get_args(field.annotation)):  # SplitConfig, SelectBest | None
            if isinstance(nested, type) and issubclass(nested, Section):
                out += rows(nested, f"{prefix}{name}.")
    return out


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(model: type[BaseModel], prefix: str, names: list[str] | None = None, keyed: bool = True) -> list[str]:
    """One row per field; `keyed`: with the key/runtime column (pipeline fields; a sweep's are not keyed)."""
    head = ["field", "type", "default", *(["key"] if keyed else []), "description"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, field in rows(model, prefix):
        if names is not None and name not in names:
            continue
        kind = type_text(Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation)
        if bounds := bounds_text(field):
            kind += f" ({bounds})"
        where = [("runtime" if is_runtime(field) else "key")] if keyed else []
        cells = [f"`{name}`", kind, default_text(field), *where, cell(field.description or "")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render() -> str:
    """The block between the markers (markers included)."""
    fields = PipelineConfig.model_fields
    top = [n for n in fields if n not in SECTIONS]
    out = [START, NOTE, "", "Top level of each pipeline:", "", *table(PipelineConfig, "", top)]
    for section in SECTIONS:
        model = fields[section].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        out += ["", f"`{section}:` — {fields[section].description}", "", *table(model, f"{section}.")]
    out += ["", "`sweeps:` (top level of pipeline.yaml, beside `pipelines:`) — named sweeps, each the variants of a base "
            "pipeline run through the same store (`finetune sweep NAME`):",
            "", *table(SweepConfig, "sweeps.NAME.", keyed=False)]
    return "\n".join([*out, "", END])


def current(text: str) -> str | None:
    """The block as the document holds it now, or None when the markers are missing."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return None
    return text[start:end + len(END)]


def write(readme: Path = REFERENCE_DOC) -> bool:
    """Refresh the block in the document; True when it changed."""
    text = readme.read_text()
    old = current(text)
    if old is None:
        raise SystemExit(f"{readme}: no {START!r} ... {END!r} markers; add them where the reference goes")
    new = render()
    if old == new:
        return False
    readme.write_text(text.replace(old, new))
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stages.pipeline.reference", description="Print docs/configuration.md's configuration reference, generated from stages/pipeline/schema.py, "
                                 "or refresh it there (--write).")
    ap.add_argument("--write", action="store_true", help="refresh the block in docs/configuration.md instead of printing it")
    args = ap.parse_args(argv)
    if args.write:
        print(f"{REFERENCE_DOC.relative_to(REFERENCE_DOC.parents[1])}: configuration reference {'updated' if write() else 'already up to date'}")
    else:
        sys.stdout.write(render() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
