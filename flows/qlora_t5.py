"""`python -m flows.qlora_t5 [--set KEY=VALUE] [--only STAGE] [--force STAGE]`: the qlora-t5-billsum pipeline."""

import sys

from flows.finetune import main

if __name__ == "__main__":
    sys.exit(main("qlora-t5-billsum"))
