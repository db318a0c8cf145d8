"""`python -m flows.qlora_t5 [--set KEY=VALUE] [--only STAGE] [--force STAGE]` (= `finetune run qlora-t5-billsum`): the
qlora-t5-billsum pipeline as a Prefect flow."""

import sys
from functools import partial

from flows.console import closed_pipe_quiet
from flows.orchestration.launch import run_main

main = partial(run_main, default_pipeline="qlora-t5-billsum", prog="python -m flows.qlora_t5")

if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
