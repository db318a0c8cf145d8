"""The methods: what is learned, one module each (stages/methods/base.py says what a method owns; registry.py finds
one by name). A pipeline names its method at the top (`method: sft`, or `method: {name: sft, ...its settings}`).
Importing this package registers the built-in methods' settings with the schema."""

from __future__ import annotations

from stages.engine.errors import ConfigError
from stages.methods.registry import BUILTIN, data_of, method_in, method_of, user_files
from stages.pipeline import schema
from stages.pipeline.schema import MethodConfig

__all__ = ["BUILTIN", "data_of", "method_in", "method_of", "user_files"]


def _settings(name: str) -> type[MethodConfig]:
    try:
        return method_of(name).settings
    except ConfigError as e:
        raise ValueError(str(e).removeprefix(f"method {name}: ")) from None


def _register() -> None:
    for name in BUILTIN:
        schema.METHOD_SETTINGS[name] = method_of(name).settings
    schema.settings_loader[:] = [_settings]


_register()
