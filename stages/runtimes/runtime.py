"""What a runtime is (`finetune predict --runtime NAME`, one module of stages/runtimes each, registered in RUNTIMES
in stages/runtimes/__init__.py): which exports it runs, how it loads an export folder into a model that
batched inference (stages/models/inference.py) runs, and whether autocast reaches it. stages/runtimes/exported.py
and the predict command look a runtime up by name and never branch on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Runtime:
    name: str = ""
    engine: str = ""  # what computes: torch, onnxruntime, llama.cpp
    help: str = ""  # for `finetune predict --help`
    answers_chats: bool = True  # a chat export's conversations (--chat, --messages-column)
    own_precision: bool = False  # computes on the CPU in its file's own precision: no device or autocast choice

    def chat_refusal(self) -> str:
        """The one line for a conversation given to a runtime that does not answer them."""
        return f"--runtime {self.name}: {self.engine} does not answer conversations; a chat runs with --runtime torch"

    def refuse(self, folder: Path, method: Any) -> None:
        """One line (ConfigError) when this runtime cannot run the export's method."""

    def load(self, folder: Path, method: Any) -> Any:
        """The export folder's model as this runtime runs it (eval mode is set by the caller)."""
        raise NotImplementedError
