"""`python -m flows.bloom_imdb [--set KEY=VALUE] [--only STAGE] [--force STAGE]` (= `finetune run bloom-imdb`): the
bloom-imdb pipeline as a Prefect flow."""

import sys
from functools import partial

from flows.console import closed_pipe_quiet
from flows.orchestration.launch import run_main

main = partial(run_main, default_pipeline="bloom-imdb", prog="python -m flows.bloom_imdb")

if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
