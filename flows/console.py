"""The `finetune` console command ([project.scripts]; also `python -m flows`): one subcommand per entry point,
each the `main` of a `flows/<module>.py`, the way `dvc` and `prefect` group theirs.

    finetune run PIPELINE [--set KEY=VALUE] [--only STAGE] [--until STAGE] [--force STAGE] [--verify] [--track]
    finetune sweep NAME | PIPELINE --grid KEY=V1,V2 [--seeds 1,2,3] [--parallel N]
    finetune serve [PIPELINE ...]
    finetune inspect status|show|path|gc|memory|compare|diff|runs ...
    finetune summary PIPELINE [--if-cached]
    finetune predict ...
    finetune methods [--config FILE]
    finetune serve-model PIPELINE|EXPORT_FOLDER ... [--base] [--port 8000]
    finetune server [--host 127.0.0.1] [--port 4200]

A subcommand's module is imported only when it runs: `finetune inspect` never imports Prefect. Every entry point
(this command and each `python -m flows.<module>`) runs through `closed_pipe_quiet`: `finetune inspect runs | head`
ends without a BrokenPipeError traceback.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

# subcommand -> (module whose main(argv) runs it, what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("flows.finetune", "run a pipeline of pipeline.yaml as a Prefect flow (cached stages are reused)"),
    "sweep": ("flows.sweep", "run a sweep's variants through one store, then compare them"),
    "serve": ("flows.serve", "serve one deployment per pipeline and sweep on a Prefect server"),
    "inspect": ("flows.inspect", "read the store: status, show, path, gc, memory, compare, diff, runs"),
    "summary": ("flows.summary", "summarize a pipeline's artifacts (--if-cached: reuse them without Prefect)"),
    "predict": ("flows.predict", "predictions from a trained pipeline's model"),
    "methods": ("flows.methods", "the training methods: what each learns, its head, the pipelines using it"),
    "serve-model": ("flows.serve_model", "serve exports in the OpenAI API's shape, with a playground page"),
    "server": ("flows.server", "the Prefect server (API and UI) on the project's Prefect home"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: finetune COMMAND [ARGS ...]", "",
             "Finetune LLMs on one GPU as Prefect flows of content-hash-cached stages.", "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "`finetune COMMAND --help` for a command's options; every command is also "
              "`python -m flows.<module>`."]
    return "\n".join(lines)


def closed_pipe_quiet(command: Callable[[], int | None]) -> int | None:
    """command(), its output flushed; a reader that went away early (`| head`) ends it with exit code 1 and no
    traceback (a `python -m flows.<module>` entry point; `main` below inlines the same)."""
    try:
        try:
            return command()
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        return stdout_gone()


def stdout_gone() -> int:
    """The recipe of CPython's docs (signal, "Note on SIGPIPE"): after the BrokenPipeError, point stdout at
    devnull so the interpreter's own flush at exit has nothing left to fail on; exit code 1."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        try:
            if not argv or argv[0] in ("-h", "--help", "help"):
                print(usage())
                return 0 if argv else 2
            if argv[0] == "--version":
                try:
                    print(f"finetune {version('finetune')}")
                except PackageNotFoundError:
                    print("finetune (not installed)")
                return 0
            name, rest = argv[0], argv[1:]
            if name not in COMMANDS:
                print(f"error: unknown command '{name}'; commands: {', '.join(COMMANDS)} (finetune --help)",
                      file=sys.stderr)
                return 2
            module_name = COMMANDS[name][0]
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as e:
                if e.name != module_name:
                    raise
                print(f"error: finetune {name}: this install has no {module_name} module yet", file=sys.stderr)
                return 2
            command = module.main  # the subcommand runs in this frame's callee: no dispatch frames between
            if "prog" in inspect.signature(command).parameters:
                return command(rest, prog=f"finetune {name}") or 0
            return command(rest) or 0
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        return stdout_gone()


if __name__ == "__main__":
    sys.exit(main())
