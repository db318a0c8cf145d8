"""What the engine is handed about a project's pipelines, so that it names none of their sections: the config
they are validated against (`Schema`), what a run checks beyond the stages' own checks, the hooks every run
carries (Kedro's before/after_node_run, on_node_error), and what a command line's options turn on. A graph
carries its project (stages/graph.py builds the finetuning one)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from stages.engine.config import Schema

if TYPE_CHECKING:
    import argparse

    from stages.engine.plan import Planned
    from stages.engine.runner import Execution
    from stages.engine.store import Outcome


class Pipeline(Protocol):
    """What the engine reads of a pipeline's config; every other field is the stages'."""

    @property
    def name(self) -> str: ...

    @property
    def overrides(self) -> list[str]: ...

    @property
    def config_file(self) -> str | None: ...

    def overrides_within(self, reads: tuple[str, ...]) -> list[str]: ...


class Hook:
    """Something that hangs on a run (run records, experiment tracking, a UI, printed lines): the one loop
    (stages/engine/runner.py `Execution`) calls each method at its point, in the order the hooks were
    registered; each does nothing unless overridden. `run` is the Execution: its plan, store, outcomes so far
    and `tags` (what identifies the run: its store, its record, the caller's; a hook may add to them in
    before_run for the hooks after it)."""

    def before_run(self, run: Execution) -> None:
        """The run starts: its upstream (--only) read, nothing computed yet."""

    def before_stage(self, run: Execution, item: Planned) -> None:
        """A step is about to run (or be looked up in the store)."""

    def after_stage(self, run: Execution, outcome: Outcome) -> None:
        """A step finished: computed, a store hit, or joined (another machine commits it)."""

    def on_error(self, run: Execution, stage: str | None, error: BaseException) -> None:
        """The run failed in `stage` (None: between stages), with what raised or the driver's message."""

    def after_run(self, run: Execution, status: str) -> None:
        """The run ended: FINISHED, FAILED (on_error came first) or KILLED (interrupted)."""


def _nothing(_: Any) -> None:
    return None


@dataclass(frozen=True)
class Project:
    """A graph's pipelines: their schema; `check_run`, called on a resolved config at plan time for a run (not
    for a report such as status), may refuse it in one ConfigError; `hooks` makes the hooks of one run;
    `options` applies a command line's options to this process (before its config loads)."""

    schema: Schema[Any, Any]
    check_run: Callable[[Any], None] = _nothing
    hooks: Callable[[], Sequence[Hook]] = field(default=tuple)
    options: Callable[[argparse.Namespace], None] = _nothing
