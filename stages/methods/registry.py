"""Finding a method by its name: a built-in one is a module of this package holding one `METHOD`, a user's own is
`MODULE:CLASS` or `path/to/file.py:CLASS`. This module imports no method (nor their base class): a stage that
looks its method up by name has this module in its code fingerprint, and the graph adds the part of the
pipeline's own method it runs (stages/graph.py), so editing one method reruns no other method's pipelines."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.engine.errors import ConfigError
from stages.pipeline.schema import LEGACY_TASKS

if TYPE_CHECKING:
    from stages.methods.base import Method, MethodData

BUILTIN = ("classify", "seq2seq", "sft")  # modules of this package, in `finetune methods` order
METHOD_ATTRS = ("settings", "data", "features", "collate", "prepare", "step", "stages")  # what a Method has
_USER: dict[str, tuple[Method, str]] = {}


def method_of(name: str) -> Method:
    """The method `name` names: a built-in one (or model.task's old name for it), or a user's MODULE:CLASS /
    path.py:CLASS."""
    name = LEGACY_TASKS.get(name, name)
    if name in BUILTIN:
        return importlib.import_module(f"stages.methods.{name}").METHOD
    if ":" in name:
        version = "".join(f"{f}:{f.stat().st_mtime_ns}:{f.stat().st_size};" for f in user_files(name))
        if _USER.get(name, (None, ""))[1] != version:  # loaded again once its files change
            _USER[name] = (_load_user(name), version)
        return _USER[name][0]
    raise ConfigError(f"method: {name!r} is not a method; use one of {', '.join(BUILTIN)}, or your own as "
                      f"MODULE:CLASS or path/to/file.py:CLASS (`finetune methods` lists them)")


def method_in(cfg: Any) -> Method:
    """The method of a pipeline's config, with its settings."""
    return method_of(cfg.method.name).bound(cfg.method)


def user_files(name: str) -> list[Path]:
    """The source files of a user's method: its module and the modules beside it that it imports, directly or
    through each other (their content is in the keys of the stages that run it, so an edit to code the method
    runs reruns them, and an edit to another file does not). [] for a built-in method (its code is in those
    keys through the code fingerprint)."""
    if name in BUILTIN or ":" not in name:
        return []
    module = name.rsplit(":", 1)[0]
    if module.endswith(".py"):
        first = Path(module).expanduser().resolve()
    else:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin:
            return []
        first = Path(spec.origin).resolve()
    found, todo = [], [first]
    while todo:
        f = todo.pop()
        if f in found or not f.is_file():
            continue
        found.append(f)
        todo += [f.parent / f"{n}.py" for n in _imported(f)] + [f.parent / n / "__init__.py" for n in _imported(f)]
    return sorted(found)


def _imported(file: Path) -> set[str]:
    """The first part of every module a file imports (absolute and relative)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
    return names


def _load_user(name: str) -> Method:
    module_name, _, cls_name = name.rpartition(":")
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"method {name}: {path} not found; give MODULE:CLASS or path/to/file.py:CLASS")
        if str(path.parent) not in sys.path:  # its own modules beside it import, as when run as a script
            sys.path.insert(0, str(path.parent))
        unique = "finetune_user_method_" + "".join(c if c.isalnum() else "_" for c in str(path))
        spec = importlib.util.spec_from_file_location(unique, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[unique] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError(f"method {name}: cannot import {module_name} ({e}); give MODULE:CLASS or "
                              f"path/to/file.py:CLASS") from None
    cls = getattr(module, cls_name, None)
    if not (isinstance(cls, type) and all(hasattr(cls, part) for part in METHOD_ATTRS)):
        raise ConfigError(f"method {name}: {module_name} has no Method subclass {cls_name}; define "
                          f"`class {cls_name}(stages.methods.base.Method)` there (docs/methods.md)")
    return cls()


def data_of(name: str) -> MethodData:
    """The columns the method `name` needs of its data (what the data stage reads of it)."""
    return method_of(name).data
