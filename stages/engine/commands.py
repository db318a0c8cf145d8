"""Command lines the project prints for the user (hints, fix lines, the export card): they repeat the
pipeline file, the sweep's name and the --set list, so that each works as printed."""

from __future__ import annotations

import shlex
from pathlib import Path

from stages.engine.config import is_project_file, override_strings


def config_args(config: Path | str | None) -> list[str]:
    """`--config FILE` (absolute) for a command the project prints, [] for the project's own file."""
    if config is None or is_project_file(config):
        return []
    return ["--config", str(Path(config).resolve())]


def command(subcommand: str, *args: str, config: Path | str | None = None,
            overrides: list[str] | dict | None = None, name: str | None = None) -> str:
    """A command line the project prints for the user to run: `finetune SUBCOMMAND ARGS` (the console command,
    which an installed wheel has too; `python -m flows...` needs the checkout's interpreter), repeating the
    pipeline file, the sweep's --name and the --set list, shell-quoted, so that it works as printed."""
    parts = ["finetune", subcommand, *args, *config_args(config), *(["--name", name] if name else []),
             *(a for o in override_strings(overrides) for a in ("--set", o))]
    return shlex.join(parts)
