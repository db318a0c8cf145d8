"""The hooks of a run (Kedro's before/after_node_run, on_node_error): what a hook sees of a run and the points the
one loop (stages/engine/runner.py `Execution`) calls. Kept apart from the plan so that a command that only
prints lines (`finetune predict`) imports no store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from stages.engine.store import Outcome, Store


class Run(Protocol):
    """What a hook sees of a run (stages/engine/runner.py `Execution`)."""

    plan: Any  # its Plan (stages/engine/plan.py, which imports this module)
    store: Store
    outcomes: list[Outcome]  # the steps finished so far, in order
    # what identifies the run: its store, its record, the caller's (a Prefect flow run); a hook may add to
    # them in before_run, for the hooks after it
    tags: dict[str, str]

    def transfers(self) -> dict[str, int] | None: ...

    def transfer_line(self) -> str | None: ...


class Hook:
    """Something that hangs on a run (run records, experiment tracking, a UI, printed lines), as Kedro's
    hooks do: the one loop (stages/engine/runner.py `Execution`) calls each method at its point, in the order
    the hooks were registered; each does nothing unless overridden."""

    def before_run(self, run: Run) -> None:
        """The run starts: its upstream (--only) read, nothing computed yet."""

    def before_stage(self, run: Run, item: Any) -> None:  # a plan's Planned step
        """A step is about to run (or be looked up in the store)."""

    def after_stage(self, run: Run, outcome: Outcome) -> None:
        """A step finished: computed, a store hit, or joined (another machine commits it)."""

    def on_error(self, run: Run, stage: str | None, error: BaseException) -> None:
        """The run failed in `stage` (None: between stages), with what raised or the driver's message."""

    def after_run(self, run: Run, status: str) -> None:
        """The run ended: FINISHED, FAILED (on_error came first) or KILLED (interrupted)."""
