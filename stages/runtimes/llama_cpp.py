"""--runtime gguf / gguf-q8_0: a causal LM export's gguf/model-f16.gguf / model-q8_0.gguf (export.formats
[hf, gguf]) in llama.cpp, greedy, on the CPU (stages/formats/gguf_export.py writes and checks them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.engine.errors import ConfigError
from stages.runtimes.runtime import Runtime


class LlamaCpp(Runtime):
    engine = "llama.cpp"
    own_precision = True

    def __init__(self, name: str, help: str) -> None:
        self.name, self.help = name, help

    def refuse(self, folder: Path, method: Any) -> None:
        if not method.head.decoder_only:
            raise ConfigError(f"--runtime {self.name}: {folder} is a {method.name} export; GGUF exports are of causal "
                              f"LMs (method sft): give --runtime torch")

    def load(self, folder: Path, method: Any) -> Any:
        from stages.formats.gguf_export import runtime_model

        return runtime_model(folder, self.name)


RUNTIMES = (LlamaCpp("gguf", "a causal LM export's gguf/model-f16.gguf in llama.cpp, greedy (export.formats: "
                     "[hf, gguf])"),
            LlamaCpp("gguf-q8_0", "its gguf/model-q8_0.gguf"))
