"""`python -m flows.server [--host 127.0.0.1] [--port 4200] [PREFECT ARGS...]`: `prefect server start` with the
project's Prefect settings (flows/orchestration/prefect_env.py), so the server, its UI and the command-line runs share one
database. A plain `prefect server start` uses ~/.prefect, while `python -m flows.finetune` records into
the project's .prefect/: the UI such a server shows never lists the command-line runs.

The process becomes the server (exec): Ctrl-C or `kill PID` stops it."""

from __future__ import annotations

import argparse
import os
import sys

from flows.console import closed_pipe_quiet
from flows.orchestration.prefect_env import use_project_defaults


def command(host: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port), *extra]


def main(argv: list[str] | None = None, *, prog: str = "python -m flows.server") -> int:
    p = argparse.ArgumentParser(prog=prog, description="Start the Prefect server (API and UI) "
                                "on the project's Prefect home, the database the command-line runs record into.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                   "0.0.0.0 for workers on other machines, on a network you trust)")
    p.add_argument("--port", type=int, default=4200, help="default 4200")
    args, extra = p.parse_known_args(argv)
    use_project_defaults()  # PREFECT_HOME: the project's .prefect/, unless set
    print(f"Prefect server on http://{args.host}:{args.port} with PREFECT_HOME={os.environ['PREFECT_HOME']}; "
          f"other shells: export PREFECT_API_URL=http://{'127.0.0.1' if args.host == '0.0.0.0' else args.host}:"
          f"{args.port}/api", flush=True)
    cmd = command(args.host, args.port, extra)
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
