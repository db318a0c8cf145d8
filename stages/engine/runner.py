"""Executes a plan (stages/engine/plan.py): each step through the store, in order. `execute` is the whole
run for `python -m stages`; the Prefect flow is the same loop over `Execution.pending()` with one task per
step, each task calling `run_step`. Everything else a run does (its record, tracking, printed lines, the UI)
hangs on hooks (plan.py `Hook`). The engine never names a stage: the graph is handed in with the plan."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from stages.engine.errors import (
    DiskFullError,
    FinetuneError,
    MissingInputError,
    StoreUnavailableError,
    is_disk_full,
    is_unreachable,
    store_failure,
)
from stages.engine.hooks import Hook
from stages.engine.plan import FORCE, Plan, Planned
from stages.engine.results import Results
from stages.engine.runs import RunRecords
from stages.engine.stage import JOINED, ConfigView, StageContext, stage_params
from stages.engine.status import CACHED, lookups
from stages.engine.store import Outcome, Store
from stages.engine.units import human_bytes

log = logging.getLogger("finetune")


def context_for(plan: Plan[Any], item: Planned, done: dict[str, Outcome]) \
        -> Callable[[Path, Path], tuple[StageContext[Any]]]:
    """What the stage's body is handed (its arguments), once the store gives it its output and work folders."""
    st = item.stage
    view = ConfigView(plan.cfg, st.reads, st.name)
    ups = {u: done[u] for u in st.upstream}
    return lambda out, work: (StageContext(
        cfg=view, out_dir=out, work_dir=work, upstream={u: o.path for u, o in ups.items()},
        upstream_manifests={u: o.manifest for u, o in ups.items()}, log=logging.getLogger(f"finetune.{st.name}")),)


def run_step(plan: Plan[Any], item: Planned, store: Store, done: dict[str, Outcome]) -> Outcome:
    """Run (or reuse) one planned stage. `done` holds the outcomes of its upstream stages."""
    st, sk, force = item.stage, item.key, item.action == FORCE
    missing = [u for u in st.upstream if u not in done]
    if missing:
        raise MissingInputError(f"stage {st.name}: upstream {', '.join(missing)} has not run; run the pipeline "
                                f"without --only first: {plan.run_command()}")
    digests = {u: done[u].manifest["digest"] for u in st.upstream}
    context = context_for(plan, item, done)
    try:
        # the store decides again under the key's lock; looked up here only for what precedes computing
        hit = not force and (st.joins or st.precheck) and store.lookup(sk, dict(digests), plan.verify).hit
        # joining another machine's run, unless its artifact is in the store already (nobody there to join)
        if st.joins is not None and (role := st.joins(plan.cfg)) and not hit:
            store.fetch_upstream(sk, digests)  # the body reads them here, outside the store's run
            return joined_stage(item, store, context, role)
        if st.precheck and not hit:  # about to compute (forced included): e.g. the memory-fit check
            st.precheck(plan.cfg)
        outcome = store.run(sk, st.body, pipeline=plan.cfg.name, config=stage_params(plan.cfg, st.reads),
                            upstream_digests=digests, force=force, verify=plan.verify, args=context,
                            volatile=st.volatile)
        store.set_ref(plan.cfg.name, st.name, sk.key)
    except Exception as e:  # a full disk or a store that stopped answering: one line, not a traceback
        if is_unreachable(e) and not isinstance(e, FinetuneError):
            raise StoreUnavailableError(f"stage {st.name}: the store {store} stopped answering: {store_failure(e)}; "
                                        f"nothing of {st.name} was committed and the stages before it stay in the "
                                        f"store: rerun once it answers, which reuses them") from e
        if not is_disk_full(e):
            raise
        raise DiskFullError(f"stage {st.name}: the disk is full ({e.__class__.__name__}: {str(e)[:120]}); "
                            f"{free_space(store)}; no artifact is half-written (each is committed whole or not at "
                            f"all) and committed stages stay in the store: free space (finetune inspect gc "
                            f"--force) or set FINETUNE_STORE to a larger disk, then rerun") from e
    return outcome


def check_store_writable(plan: Plan[Any], store: Store, note: bool = True) -> None:
    """Before anything runs (a command line calls it before Prefect starts, and every Execution): a store this
    process cannot write (a read-only folder, a missing bucket, no rights) is refused in one line, unless the
    run needs no write: every stage it runs is a store hit. Then the store is used read-only (no refs, events,
    run record or gc registration are written), with a warning."""
    if store.read_only or (why := store.unwritable()) is None:
        return
    try:
        found = lookups(plan, store)
    except Exception as e:  # it cannot be read either (an endpoint that does not answer)
        raise StoreUnavailableError(f"the store {store} cannot be written: {why}; fix that, or set FINETUNE_STORE "
                                    f"to a store you can write") from e
    compute = [i.name for i in plan.steps if i.action == FORCE or found[i.name].why != CACHED]
    if compute:
        raise StoreUnavailableError(
            f"the store {store} cannot be written: {why}; stage {compute[0]} must be computed "
            f"({'forced' if plan[compute[0]].action == FORCE else found[compute[0]].why}) and cannot be committed "
            f"there. Make it writable (or create its bucket), or set FINETUNE_STORE to a store you can write (a "
            f"store that cannot be written serves fully cached runs only)")
    store.read_only = True
    if note:
        log.warning("store %s cannot be written (%s); every stage is cached, so this run only reads it: no refs, "
                    "events or run record are written there", store, why)


def free_space(store: Store) -> str:
    """The free space on the store's disk, for a disk-full line."""
    try:
        return f"{human_bytes(shutil.disk_usage(store.root).free)} free in the store {store.root}"
    except OSError:
        return f"the store is {store.root}"


def joined_stage(item: Planned, store: Store, context: Callable[[Path, Path], tuple[StageContext[Any]]],
                 role: str) -> Outcome:
    """Run the body to help another machine compute the stage (Stage.joins): in a scratch folder, without
    the key's lease (that machine holds it) and committing nothing."""
    log.info("%s: %s; nothing is committed here", item.name, role)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"finetune-{item.name}-joined-") as scratch:
        out, work = Path(scratch) / "out", Path(scratch) / "work"
        out.mkdir()
        work.mkdir()
        metrics = item.stage.body(*context(out, work)) or {}
    return Outcome(item.name, item.key.key, store.artifact_dir(item.name, item.key.key), False, JOINED,
                   {"duration_s": time.perf_counter() - t0, "metrics": metrics, "role": role})


def read_upstream(plan: Plan[Any], store: Store) -> dict[str, Outcome]:
    """For --only STAGE: its upstream stages' artifacts (the plan's READ steps), which must be hits."""
    done: dict[str, Outcome] = {}
    for item in plan.reads:  # in pipeline order: a stage's upstream is in `done` before the stage
        sk = item.key
        found = store.lookup(sk, {u: done[u].manifest["digest"] for u in item.stage.upstream}, plan.verify)
        if not found.hit or found.manifest is None:  # its files are fetched when the stage computes
            raise MissingInputError(f"--only {plan.steps[0].name}: upstream stage {item.name} is not in the store "
                                    f"for this config ({found.why}); run the whole pipeline first: "
                                    f"{plan.run_command()}")
        done[item.name] = Outcome(sk.stage, sk.key, store.artifact_dir(sk.stage, sk.key), False, "cached",
                                  found.manifest)
    return done


class Execution:
    """One run of a plan, the loop every driver shares: `pending()` yields its steps in order, `finished()`
    takes each one's outcome (`done`: what the next step's upstream reads), `fail()` ends it on a step that
    failed without raising here. Used as a context manager around that loop; the run ends with the plan,
    after a JOINED step (nothing of it here for the stages after), or failed with what raised.

    Everything else hangs on hooks (stages/engine/plan.py `Hook`), called in this order: the run records and
    the result record (the engine's own), the project's (stages/graph.py: experiment tracking), then the
    driver's (`python -m stages`: its printed lines; the Prefect flow: the UI's artifacts). `tags`: what
    identifies the run to them (its store, its record, the caller's: e.g. its Prefect flow run)."""

    def __init__(self, plan: Plan[Any], store: Store, tags: dict[str, str] | None = None,
                 hooks: Sequence[Hook] = ()):
        self.plan, self.store = plan, store
        check_store_writable(plan, store)
        if freed := store.sweep_tmp():  # what runs that died on this store left in .tmp
            log.info("store: removed %s of dead runs' temporary folders (.tmp)", human_bytes(freed))
        self.done = read_upstream(plan, store)
        self.outcomes: list[Outcome] = []
        self.current: str | None = None
        self.failed = False
        self.tags = {"finetune.store": str(store), **(tags or {})}
        project = plan.graph.project
        self.hooks: list[Hook] = [RunRecords(), Results(), *(project.hooks() if project else ()), *hooks]
        self._moved_before = store.transfers()

    def transfers(self) -> dict[str, int] | None:
        """What this run has moved to and from a shared store so far (None on a local store)."""
        now, before = self.store.transfers(), self._moved_before
        return None if now is None or before is None else {k: now[k] - before.get(k, 0) for k in now}

    def transfer_line(self) -> str | None:
        """The run's closing line on a shared store: its requests and the bytes each way."""
        moved = self.transfers()
        if moved is None:
            return None
        return (f"store {self.store}: {moved['get']} GET {human_bytes(moved['get_bytes'])}, {moved['put']} PUT "
                f"{human_bytes(moved['put_bytes'])}, {moved['other']} other requests")

    def pending(self) -> Iterator[Planned]:
        for item in self.plan.steps:
            self.current = item.name
            for hook in self.hooks:
                hook.before_stage(self, item)
            yield item
            if self.outcomes and self.outcomes[-1].reason == JOINED:
                log.info("%s joined another machine's run: the stages after it run there", item.name)
                return

    def finished(self, outcome: Outcome) -> Outcome:
        self.done[outcome.stage] = outcome
        self.outcomes.append(outcome)
        for hook in self.hooks:
            hook.after_stage(self, outcome)
        self.current = None
        return outcome

    def __enter__(self) -> Execution:
        # every key the run reads or writes stays out of gc's reach until it ends
        self._held = contextlib.ExitStack()
        self._held.enter_context(self.store.protecting((i.key.stage, i.key.key) for i in self.plan.items))
        for hook in self.hooks:
            hook.before_run(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self._held.close()
        if err is not None:
            self._error(self.current, err)
        status = "FAILED" if self.failed else "KILLED" if err is not None else "FINISHED"
        for hook in self.hooks:
            hook.after_run(self, status)

    def fail(self, message: str) -> None:
        """The current step failed without raising here (the flow's task ended Failed)."""
        self._error(self.current, RuntimeError(message))
        self.current = None

    def _error(self, stage: str | None, err: BaseException) -> None:
        self.failed = self.failed or isinstance(err, Exception)
        for hook in self.hooks:
            hook.on_error(self, stage, err)


def execute(plan: Plan[Any], store: Store, hooks: Sequence[Hook] = ()) -> list[Outcome]:
    """Run the plan's steps in order through the store, in this process (`python -m stages`, tests, the
    summary), with the driver's `hooks` after the engine's and the project's."""
    with Execution(plan, store, hooks=hooks) as run:
        for item in run.pending():
            run.finished(run_step(plan, item, store, run.done))
    return run.outcomes
