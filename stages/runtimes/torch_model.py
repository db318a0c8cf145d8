"""--runtime torch (the default): the export folder's Hugging Face model in torch, loaded the way a user loads it:
the method's head's Auto class, or AutoPeftModelFor... for an adapter at the top."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.runtimes.runtime import Runtime


class Torch(Runtime):
    name = "torch"
    engine = "torch"
    help = "the Hugging Face model (default)"

    def load(self, folder: Path, method: Any) -> Any:
        import transformers

        if (folder / "adapter_config.json").is_file():
            import peft

            return getattr(peft, method.head.auto_class.replace("AutoModel", "AutoPeftModel")).from_pretrained(str(folder))
        return getattr(transformers, method.head.auto_class).from_pretrained(str(folder), use_safetensors=True)


RUNTIMES = (Torch(),)
