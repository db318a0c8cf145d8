"""Known-harmless third-party warnings, filtered precisely: each by its category, the start of its message
and the module that raises it, so any other warning (a new one, or this one from elsewhere) still shows.

    transformers  `is_gradient_checkpointing` is deprecated (FutureWarning): PEFT and accelerate still read
                  the old name on transformers 5; train.enable_gradient_checkpointing uses the new one.
    peft          tied embeddings with a tied layer in the adapter, and "no longer tied after merging"
                  (UserWarnings): lm_head in modules_to_save of a tied model; the export stage unties it when
                  training made it differ (export.untie_if_diverged), the complication both are about.
    bitsandbytes  "Failed to load CPU gemm_4bit_forward from kernels-community" (a log record at import on
                  CPUs with AVX512-BF16 when the optional `kernels` package is absent or offline): its plain
                  CPU kernels are used instead, the ones the evaluate stage asks for anyway.
"""

from __future__ import annotations

import logging
import re
import warnings

KNOWN_WARNINGS = (
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated", r"transformers\.modeling_utils"),
    (UserWarning, r"Model has `tie_word_embeddings=True` and a tied layer is part of the adapter",
     r"peft\.tuners\.tuners_utils"),
    (UserWarning, r"Input and output embeddings are no longer tied after merging", r"peft\.tuners\.tuners_utils"),
)
KNOWN_LOG_RECORDS = {
    "bitsandbytes.backends.cpu.ops": r"Failed to load CPU gemm_4bit_forward from kernels-community",
}


class _DropMessage(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(str(record.msg))


def filter_known_warnings() -> None:
    """Install the filters (idempotent: warnings moves an identical filter to the front, not twice)."""
    for category, message, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, pattern in KNOWN_LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropMessage(pattern))
