"""`python -m flows COMMAND ...`: the `finetune` console command (flows/console.py)."""

import sys

from flows.console import main

sys.exit(main())
