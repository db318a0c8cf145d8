"""llama.cpp in a process of its own: the script the GGUF check and `finetune predict --runtime gguf` start
(stages/formats/gguf_export.py `LlamaProcess`), run as `python -P llama_child.py`. Native kernels can meet an
instruction this CPU (or its VM) will not run, and die by a signal no Python code can catch: here that ends this
process, never the stage's or the test worker's, and the parent turns it into one line.

It speaks JSON lines: one request a line on stdin ({"op": "load" | "greedy" | "tokenize", ...}), one answer a line
({"result": ...} or {"error": "..."}) on the stdout it was started with. Whatever the native library prints goes
to stderr. It imports only the standard library and llama_cpp, nothing of the project."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def greedy(llm: Any, prompt: list[int], max_new: int, stops: set[int]) -> list[int]:
    """llama.cpp's greedy continuation of `prompt` (token ids), up to and including a stop token."""
    out: list[int] = []
    if max_new <= 0:
        return out
    for t in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(t))
        if t in stops or len(out) >= max_new:
            break
    return out


def answer(llm: Any, req: dict[str, Any]) -> Any:
    op = req["op"]
    if op == "greedy":
        return greedy(llm, req["prompt"], req["max_new"], set(req["stops"]))
    if op == "tokenize":
        return llm.tokenize(req["text"].encode(), add_bos=False, special=True)
    raise ValueError(f"unknown op {op!r}")


def serve() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the library's own prints cannot interleave with the answers
    llm: Any = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "load":
                import llama_cpp

                llm = llama_cpp.Llama(model_path=req["path"], n_ctx=req["n_ctx"], n_threads=req["threads"],
                                      n_threads_batch=req["threads"], seed=0, verbose=False)
                result = None
            else:
                result = answer(llm, req)
        except Exception as e:  # a refusal the parent reports in its words; the process lives on
            replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
            continue
        replies.write(json.dumps({"result": result}) + "\n")
    if llm is not None:
        llm.close()


if __name__ == "__main__":
    serve()
