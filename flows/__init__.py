"""The pipeline's command lines and their Prefect wiring, in three parts:

- `flows/<command>.py` (finetune, bloom_imdb, qlora_t5, sweep, serve, inspect, summary): the entry points,
  `python -m flows.<command>` and the `finetune <command>` console command (flows/console.py); each a thin
  shim with `main(argv) -> int`.
- `flows/orchestration/`: the Prefect glue (the `finetune` and `sweep` flows, UI artifacts, serving, log
  routing, signal handling, Prefect workarounds). Never imports tensor libraries.
- `flows/reports/`: what is read from the store without Prefect (status, compare, diff, summary, sweep
  definitions). Never imports Prefect.

Importing this package does nothing; `flows.orchestration` sets the project's Prefect defaults.
"""
