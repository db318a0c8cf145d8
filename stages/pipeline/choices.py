"""The string choices of a schema field, and YAML 1.1's boolean words: YAML reads no / off / yes / on (and
false / true) as booleans, and in a field of choices they mean the choice of that word
(train.mixed_precision: no)."""

from __future__ import annotations

import typing
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
