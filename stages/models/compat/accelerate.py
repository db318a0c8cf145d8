"""accelerate workaround: its process-wide AcceleratorState is a singleton, so several trainings in one
process (tests, bench) with different settings reset it through a private method first."""

from __future__ import annotations

WRITTEN_FOR = "accelerate>=1.15,<1.16"


def reset_accelerator_state() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
