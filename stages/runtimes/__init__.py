"""Runtimes, by the name `finetune predict --runtime` gives (stages/runtimes/runtime.py says what a runtime owns).
A new runtime is one module here whose RUNTIMES are added to RUNTIMES below; the predict command offers their
names and stages/runtimes/exported.py loads an export with the one named."""

from __future__ import annotations

from stages.engine.errors import ConfigError
from stages.runtimes import llama_cpp, onnx_runtime, torch_model
from stages.runtimes.runtime import Runtime

RUNTIMES: dict[str, Runtime] = {r.name: r for m in (torch_model, onnx_runtime, llama_cpp) for r in m.RUNTIMES}


def runtime_of(name: str) -> Runtime:
    if name not in RUNTIMES:
        raise ConfigError(f"--runtime {name}: not one of {', '.join(RUNTIMES)}; give one of those")
    return RUNTIMES[name]
