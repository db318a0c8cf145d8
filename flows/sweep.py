"""`python -m flows.sweep NAME | PIPELINE --grid KEY=V1,V2 ... [--parallel N]` (= `finetune sweep`): variants of
a pipeline as child runs of the `sweep` flow through one store; flows/orchestration/launch.py."""

import sys

from flows.console import closed_pipe_quiet
from flows.orchestration.launch import sweep_main as main

if __name__ == "__main__":
    sys.exit(closed_pipe_quiet(main))
