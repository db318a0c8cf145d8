"""The string choices of a schema field, and YAML 1.1's boolean words: YAML reads no / off / yes / on (and
false / true) as booleans, and in a field of choices they mean the choice of that word
(train.mixed_precision: no). A field whose choices are a registry's names: OneOf."""

from __future__ import annotations

import importlib
import typing
from dataclasses import dataclass
from typing import Any, Literal

BOOL_WORDS = {False: ("no", "off", "false", "none"), True: ("yes", "on", "true")}


def choices(annotation: Any) -> tuple[str, ...]:
    """The string choices of a Literal field (also inside `X | None`); () for any other field."""
    if typing.get_origin(annotation) is Literal:
        return tuple(a for a in typing.get_args(annotation) if isinstance(a, str))
    return tuple(c for a in typing.get_args(annotation) for c in choices(a))


def choice_of(value: bool, annotation: Any) -> str | None:
    """The choice a YAML boolean stands for in a field of this annotation, or None."""
    return next((w for w in BOOL_WORDS[value] if w in choices(annotation)), None)


@dataclass(frozen=True)
class OneOf:
    """A string field whose value names an entry of a registry (`module`.`attr`, a mapping name -> entry) kept by
    a package above the schema in the layers: named here, not imported (as the graph names stage bodies), and
    imported on the first check. A pydantic validator (AfterValidator(OneOf(...))); the configuration reference
    lists its names."""

    module: str
    attr: str

    def names(self) -> tuple[str, ...]:
        return tuple(getattr(importlib.import_module(self.module), self.attr))

    def __call__(self, value: str) -> str:
        if value not in (names := self.names()):
            raise ValueError(f"{value!r} is not one of {', '.join(names)}; write one of those (each a module "
                             f"registered in {self.module.replace('.', '/')}/__init__.py {self.attr})")
        return value


def one_of(annotation: Any) -> OneOf | None:
    """The OneOf of an `Annotated[str, AfterValidator(OneOf(...))]` annotation, else None."""
    for meta in getattr(annotation, "__metadata__", ()):
        if isinstance(getattr(meta, "func", None), OneOf):
            return meta.func
    return None
