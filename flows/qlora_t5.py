"""`python -m flows.qlora_t5 [--set KEY=VALUE] [--only STAGE] [--force STAGE]` (= `finetune run qlora-t5-billsum`): the
qlora-t5-billsum pipeline as a Prefect flow."""

from __future__ import annotations

import sys

from flows.console import closed_pipe_quiet
from flows.orchestration.launch import run_main


def main(argv: list[str] | None = None, *, prog: str = "python -m flows.qlora_t5") -> int:
    return run_main(argv, default_pipeline="qlora-t5-billsum", prog=prog)


if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
