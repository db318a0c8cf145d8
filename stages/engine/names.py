"""Names a user gives that become paths (pipelines, sweeps): a short safe alphabet, so a name is never a
path of its own (`../x`, `/etc/x`, `a/b`), and the check that a path the store builds stays inside it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator

from stages.engine.errors import ConfigError

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]{0,127}")
RULE = "1-128 letters, digits and _ . + = -, starting with a letter or digit, no '..'"


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a pipeline or sweep (None when it can)."""
    if not SAFE_NAME.fullmatch(name) or ".." in name:
        return f"{name!r} is not a name: use {RULE}"
    return None


def _a_name(value: str) -> str:
    if problem := name_problem(value):
        raise ValueError(problem)
    return value


# a pipeline's or a sweep's name in the schemas: refused (one line, at load) when it is a path of its own
Name = Annotated[str, AfterValidator(_a_name)]


def inside(root: Path, path: Path) -> Path:
    """`path`, after checking that it stays under `root` (ConfigError otherwise: a name that escaped)."""
    resolved, base = path.resolve(), root.resolve()
    if resolved != base and base not in resolved.parents:
        raise ConfigError(f"{path}: outside the store {root}; names must be plain names ({RULE})")
    return path
