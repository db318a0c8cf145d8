"""--runtime onnx / onnx-int8: an export's onnx/ files (fp32 / int8; export.formats [hf, onnx]) in onnxruntime,
on the CPU: a classifier's model.onnx, a seq2seq's encoder and decoder decoding greedily
(stages/formats/onnx_export.py writes and checks them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.engine.errors import ConfigError
from stages.runtimes.runtime import Runtime


class OnnxRuntime(Runtime):
    engine = "onnxruntime"
    answers_chats = False
    own_precision = True

    def __init__(self, name: str, help: str) -> None:
        self.name, self.help = name, help

    def chat_refusal(self) -> str:
        return f"--runtime {self.name}: ONNX exports are of classifiers and seq2seq; a chat runs with --runtime torch"

    def refuse(self, folder: Path, method: Any) -> None:
        if method.head.decoder_only:
            raise ConfigError(f"--runtime {self.name}: {folder} is a {method.name} export; ONNX exports are of "
                              f"classifiers and seq2seq models: give --runtime torch (or gguf, with export.formats "
                              f"[hf, gguf])")

    def load(self, folder: Path, method: Any) -> Any:
        from stages.formats.onnx_export import runtime_model

        return runtime_model(folder, self.name)


RUNTIMES = (OnnxRuntime("onnx", "the export's onnx/ files (fp32) in onnxruntime (export.formats: [hf, onnx]; a "
                        "seq2seq decodes greedily)"),
            OnnxRuntime("onnx-int8", "its int8 onnx/ files (export.onnx_int8)"))
