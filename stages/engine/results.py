"""Results: what a user would call one — a run of a pipeline as the file has it, a `--set` variant, a sweep's
child — recorded in the store itself (`results/<id>.json`, on a shared store too), so that gc keeps it
until it is dropped by name (`inspect gc --drop`) or by age (`--older-than`).

A record is one variant: its pipeline, its `--set` list and its sweep (FINETUNE_SWEEP, set by a sweep for its
runs) make its id, and it holds the key each stage of it last made or reused. A rerun of the variant replaces
a stage's key when it changed (new code, new data), so the artifacts of its earlier keys become garbage, as
they do for `refs/`. A run writes a record only when a key changed: a fully cached rerun writes nothing (on a
shared store it reads the record once), so `updated` is when the variant's results were last made.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from stages.engine.errors import ConfigError
from stages.engine.fingerprint import canonical_json, sha256_text
from stages.engine.hooks import Hook
from stages.engine.runs import SWEEP_ENV
from stages.engine.stage import JOINED
from stages.engine.store import Outcome, Store

if TYPE_CHECKING:
    from stages.engine.hooks import Run


class Result(BaseModel):
    """One results/<id>.json."""

    id: str
    pipeline: str
    set: list[str]
    sweep: str | None
    keys: dict[str, str]  # stage -> the key the variant last made or reused
    updated: str  # when a key was last recorded (ISO 8601, UTC)

    @property
    def group(self) -> str:
        """What gc lists it under: its sweep, else its pipeline."""
        return f"sweep {self.sweep}" if self.sweep else f"pipeline {self.pipeline}"

    @property
    def handle(self) -> str:
        """The name `gc --drop` takes for this one variant: `<sweep or pipeline>@<id>`."""
        return f"{self.sweep or self.pipeline}@{self.id}"

    @property
    def label(self) -> str:
        return "variant " + " ".join(self.set) if self.set else "as in the file"


def result_id(pipeline: str, overrides: list[str], sweep: str | None) -> str:
    """The variant's id: the same pipeline, `--set` list (in any order) and sweep give the same record."""
    return sha256_text(canonical_json({"pipeline": pipeline, "set": sorted(overrides), "sweep": sweep}))[:12]


def read_results(store: Store) -> list[Result]:
    """Every result record of the store; a damaged one stops the caller (gc would guess what it keeps)."""
    out = []
    for rid, raw in store.results():
        try:
            out.append(Result.model_validate(raw))
        except ValidationError as e:
            err = e.errors()[0]
            raise ConfigError(f"store {store}: results/{rid}.json is not a result record "
                              f"({'.'.join(map(str, err['loc'])) or 'top level'}: {err['msg']}); delete it "
                              f"(gc then no longer keeps what that run made) or restore it") from None
    return out


class ResultRecorder:
    """A run's record: each stage outcome's key, written when it differs from what the record holds."""

    def __init__(self, store: Store, pipeline: str, overrides: list[str]):
        self.store = store
        self.sweep = os.environ.get(SWEEP_ENV) or None
        self.variant: dict[str, Any] = {"pipeline": pipeline, "set": list(overrides), "sweep": self.sweep}
        self.id = result_id(pipeline, list(overrides), self.sweep)
        self.known: dict[str, str] | None = None  # the stored record's keys, read at the first outcome

    def stage(self, o: Outcome) -> None:
        if o.reason == JOINED or self.store.read_only:  # a read-only store serves a cached run, records nothing
            return
        if self.known is None:
            keys = (self.store.result(self.id) or {}).get("keys")
            self.known = dict(keys) if isinstance(keys, dict) else {}
        if self.known.get(o.stage) != o.key:
            self.store.record_result(self.id, self.variant, o.stage, o.key)
            self.known[o.stage] = o.key


class Results(Hook):
    """Each finished stage's key into the run's result record, as a hook (what gc keeps until dropped)."""

    recorder: ResultRecorder

    def before_run(self, run: Run) -> None:
        self.recorder = ResultRecorder(run.store, run.plan.cfg.name, run.plan.cfg.overrides)

    def after_stage(self, run: Run, outcome: Outcome) -> None:
        self.recorder.stage(outcome)
