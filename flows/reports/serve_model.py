"""Serve exports over HTTP in the OpenAI API's shape, with a playground page (no Prefect, no training):

    finetune serve-model PIPELINE|EXPORT_FOLDER|NAME=PIPELINE_OR_FOLDER ... [--base] [--host 127.0.0.1] [--port 8000]
                         [--api-key KEY] [--runtime torch|onnx|onnx-int8|gguf|gguf-q8_0]
                         [--max-batch 8] [--max-wait-ms 10] [--max-queue 64]

(= python -m flows.serve_model; flows/serve_model.py is the shim.) Each target is found as `finetune predict`
finds it (flows/reports/predict_cli.py: a pipeline's current export in the store, or an export folder) and
loaded once (stages/runtimes/exported.py), under its pipeline's name, the folder's name or NAME. --base serves
the base model of each generating export beside it, as NAME-base, for the playground's side-by-side view. The
endpoints, their errors and the page: flows/reports/openai_api.py and docs/serving.md. SIGINT / SIGTERM stop
taking connections, finish the requests in flight, then exit 0. Bad options or targets: one line, exit 2,
before a model loads where they can be known then."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from stages.engine.cli import guarded
from stages.engine.config import DEFAULT_PIPELINE_FILE
from stages.engine.errors import ConfigError
from stages.runtimes import RUNTIMES

API_KEY_ENV = "FINETUNE_API_KEY"


def build_parser(prog: str = "python -m flows.serve_model") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve exports in the OpenAI API's shape (/v1/models, "
                                "/v1/chat/completions, /v1/completions, /v1/classifications), batched, with a "
                                "playground page at / (docs/serving.md).")
    p.add_argument("targets", nargs="+", metavar="TARGET", help="a pipeline name (its current export in the store), "
                   "an export folder, or NAME=either (served under NAME)")
    p.add_argument("--base", action="store_true", help="also serve each generating export's base model (its "
                   "pipeline's model.name) as NAME-base, for the side-by-side view")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one, printed)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help="require 'Authorization: Bearer KEY' on "
                   f"/v1/ (default: ${API_KEY_ENV} when set, else none)")
    p.add_argument("--runtime", choices=list(RUNTIMES), default="torch", help="torch (default); onnx / onnx-int8: a "
                   "classifier's onnx/ files in onnxruntime; gguf / gguf-q8_0: a causal LM's gguf/ file in llama.cpp, "
                   "greedy (as finetune predict --runtime)")
    p.add_argument("--max-batch", type=int, default=8, help="requests generated together at most (default 8)")
    p.add_argument("--max-wait-ms", type=float, default=10.0, help="how long the first request of a batch waits "
                   "for others (default 10)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting per model at most; more get 503 "
                   "(default 64)")
    p.add_argument("--config", type=Path, default=DEFAULT_PIPELINE_FILE, help="pipeline file (with pipeline names)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override of the pipelines whose exports to serve (repeatable)")
    return p


def named(target: str) -> tuple[str | None, str]:
    """NAME=TARGET -> (NAME, TARGET); a bare target -> (None, target)."""
    name, eq, rest = target.partition("=")
    if eq and name and "/" not in name:
        return name, rest
    return None, target


def check_options(args: argparse.Namespace) -> None:
    for option, value, low in (("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 1),
                               ("--port", args.port, 0)):
        if value < low:
            raise ConfigError(f"{option}: must be at least {low}, got {value}")
    if args.port > 65535:
        raise ConfigError(f"--port: at most 65535, got {args.port}")
    if args.max_wait_ms < 0:
        raise ConfigError(f"--max-wait-ms: must be 0 or more, got {args.max_wait_ms}")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key: empty; give a key, or leave it out to serve without one")
    names = [n for n, _ in map(named, args.targets) if n]
    if len(set(names)) < len(names):
        raise ConfigError(f"two targets are named alike ({', '.join(names)}); give each NAME once")


def bound_socket(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"--host {host} --port {port}: cannot bind ({e.strerror or e}); give another --port "
                          f"(0: any free one)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def load_models(args: argparse.Namespace) -> dict:
    from flows.reports.openai_api import Served
    from flows.reports.predict_cli import export_folder
    from stages.runtimes.exported import PIPELINE_JSON, load_export
    from stages.runtimes.serving import Engine, base_model, context_length, load_base

    models: dict[str, Served] = {}
    wait = args.max_wait_ms / 1000

    def add(m: Served) -> None:
        if m.name in models:
            raise ConfigError(f"two exports would be served as '{m.name}' ({models[m.name].folder} and {m.folder}); "
                              f"name them: NAME={m.folder}")
        models[m.name] = m

    for target in args.targets:
        alias, what = named(target)
        folder = export_folder(what, args.config, args.overrides)
        settings = json.loads((folder / PIPELINE_JSON).read_bytes())
        name = alias or str(settings.get("name") or folder.name)
        ex = load_export(folder, runtime=args.runtime)
        if args.runtime.startswith("onnx") and ex.method.head.generates:
            raise ConfigError(f"--runtime {args.runtime}: {folder} generates text; ONNX serving is for classifiers: "
                              f"give --runtime torch or gguf")
        kind = ("classifier" if not ex.method.head.generates else
                "chat" if getattr(ex.tok, "chat_template", None) and ex.method.head.decoder_only else "completion")
        card = (folder / "README.md").read_text(errors="replace") if (folder / "README.md").is_file() else ""
        default_max = int(getattr(ex.generation.get("generation_config"), "max_new_tokens", None) or 64)
        context = context_length(ex) if ex.method.head.generates else ex.max_length
        tuned = Served(name, Engine(ex, args.max_batch, wait, args.max_queue), kind, context, default_max, card,
                       str(folder), greedy_only=args.runtime.startswith("gguf"))
        add(tuned)
        if args.base and ex.method.head.generates:
            base_ex = load_base(ex, settings)
            base_name = f"{name}-base"
            tuned.base = base_name
            add(Served(base_name, Engine(base_ex, args.max_batch, wait, args.max_queue), kind,
                       context_length(base_ex), default_max, f"The base model of {name}: "
                       f"{base_model(settings)['name']}, with {name}'s tokenizer and generation settings.\n",
                       str(folder), base_of=name))
    if args.base and not any(m.base_of for m in models.values()):
        raise ConfigError("--base: none of the targets generates text (a classifier's base has an untrained head); "
                          "drop --base")
    return models


def graceful_server() -> type:
    """uvicorn's Server, its signal handling kept but not its last step: after a graceful stop on SIGINT /
    SIGTERM it raises the signal again (for a host process), which would turn a clean stop into an exit by
    signal; here the stop is the command's normal end, exit 0."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            before = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in before.items():
                    signal.signal(s, handler)

    return Server


def main(argv: list[str] | None = None, *, prog: str = "python -m flows.serve_model") -> int:
    args = build_parser(prog).parse_args(argv)

    def go() -> int:
        check_options(args)
        try:
            import fastapi  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"finetune serve-model needs fastapi and uvicorn (the serve extra; {e}): pip install "
                              f"-e '.[serve]'") from None
        sock = bound_socket(args.host, args.port)  # before the models load: a taken port is known at once
        import uvicorn

        from flows.reports.openai_api import AccessLog, create_app

        Server = graceful_server()

        models = load_models(args)
        app = create_app(models, args.api_key)
        logging.getLogger("finetune.serve.access").setLevel(logging.INFO)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logging.getLogger("finetune.serve").addHandler(handler)
        logging.getLogger("finetune.serve").propagate = False
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"serve-model: http://{shown}:{port}/ (the playground; the API under /v1), models: "
              + ", ".join(f"{m.name} ({m.kind})" for m in models.values())
              + ("" if args.api_key else "; no --api-key"), flush=True)
        server = Server(uvicorn.Config(AccessLog(app), log_level="warning", access_log=False,
                                               lifespan="off", timeout_graceful_shutdown=None))
        try:
            server.run(sockets=[sock])
        finally:
            for m in models.values():
                m.engine.close()  # whatever is still queued is answered first
        print("serve-model: stopped (every request in flight answered)", flush=True)
        return 0

    return guarded(go)
