"""Experiment tracking in MLflow (opt-in; docs/tracking.md): one MLflow run per pipeline run, a parent run per
sweep with its runs nested under it. Nothing here is in a cache key (no stage reads `tracking:`) and nothing of
the store depends on it: the run records, metrics.jsonl and the artifacts stay the source of truth, MLflow a copy.

Every MLflow call is made on a thread of its own (`Tracker`): training never waits on the tracking server.
Metrics are buffered and sent with `log_batch`, at most every `FLUSH_S` seconds. A server that is down, slow
or refuses a request costs one warning line; the run goes on untracked.

A run is tracked by a hook (`Tracking`, which stages/graph.py's project hangs on every run): started with the
run, fed each stage as it finishes, ended with the run. What a run holds:
- params: the resolved config, flat with dotted names (`train.lr`); tags: the `--set` list, each stage's key and
  status (computed / cached), the store, the run record, the Prefect flow run, the sweep;
- metrics: each record of a stage's history file (`Stage.history`: train's metrics.jsonl) under the name
  TensorBoard gives it (`train/loss`, `validation/val_accuracy`), MLflow's step = the optimizer step, sent
  while training runs (`live`) and, for what was not (a cached stage, a resumed run's earlier steps), from
  the file; the numbers of each reporting stage's metrics, with dots (`evaluate.splits.test.accuracy`);
- artifacts: the files a stage names in `Stage.tracked` (loss.png, metrics.json, the model card); the model
  a run produced is linked (`finetune.model_path`), not copied (docs/tracking.md says why).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.engine.errors import ConfigError
from stages.engine.hooks import Hook
from stages.engine.runs import SWEEP_ENV, outcome_status, read_metrics, scalars
from stages.engine.stage import JOINED

if TYPE_CHECKING:
    import argparse

    from stages.engine.hooks import Run
    from stages.engine.stage import Stage
    from stages.engine.store import Outcome
    from stages.pipeline.schema import PipelineConfig

log = logging.getLogger("finetune.tracking")

TRACK_ENV = "FINETUNE_TRACK"  # `--track`: tracking on for this command (and the processes it starts)
PARENT_ENV = "FINETUNE_MLFLOW_PARENT"  # a sweep's parent run: its runs nest under it
RUN_NAME_ENV = "FINETUNE_RUN_LABEL"  # a sweep's run: its variant's label as the MLflow run name
# the logger each history record is also written to while a stage computes (stages/training/runlog.py)
RECORDS_LOGGER = "finetune.records"
FLUSH_S = 5.0  # buffered metrics go out at least this often
BATCH = 1000  # MLflow's limit of metrics per log_batch request
PARAMS_PER_BATCH = 100  # ... and of params
MAX_VALUE = 5000  # a param or tag value longer than this is cut (MLflow refuses over 6000 / 8000)
# How long a client call may take: MLflow's defaults (120 s per request, 7 retries with backoff) would hold a
# run's end for many minutes on a server that went away. A user's own settings win.
CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
              "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
              "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}  # our own line names the run
CLOSE_WAIT_S = 30.0  # at the end of a run, how long the last records may take to send


@dataclass(frozen=True)
class Settings:
    uri: str
    experiment: str


def requested() -> bool:
    return os.environ.get(TRACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def settings(cfg: PipelineConfig) -> Settings | None:
    """Where this run is tracked, or None when tracking is off (the default). Raises ConfigError, one line,
    when it is on but cannot work: no server named, or MLflow not installed."""
    m = cfg.tracking.mlflow
    if not (requested() or m.enabled or (m.enabled is None and m.uri)):
        return None
    uri = m.uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ConfigError("tracking is on (--track or tracking.mlflow) but names no MLflow server: set "
                          "tracking.mlflow.uri in the pipeline file or MLFLOW_TRACKING_URI, e.g. "
                          "http://127.0.0.1:5000 (docs/tracking.md starts one)")
    if importlib.util.find_spec("mlflow") is None:
        raise ConfigError("tracking is on (--track or tracking.mlflow) but MLflow is not installed: "
                          "pip install '.[mlflow]', or run without tracking")
    return Settings(uri, m.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "finetune")


def check(cfg: PipelineConfig) -> None:
    """Plan time: tracking that is on must be able to work (settings raises the one line)."""
    settings(cfg)


def apply_option(args: argparse.Namespace) -> None:
    """`--track`: tracking on for this process and those it starts."""
    if getattr(args, "track", False):
        os.environ[TRACK_ENV] = "1"


# ------------------------------------------------------------------------------------------ what is logged
def params(cfg: PipelineConfig) -> dict[str, str]:
    """The resolved config as MLflow params: flat, dotted names, JSON for lists and null (the --set list is
    a tag, the loader's bookkeeping fields are left out)."""
    return param_values(cfg.model_dump(mode="json", exclude={"overrides", "config_file", "extends"}))


def param_values(data: dict[str, Any]) -> dict[str, str]:
    return {k: clip(v if isinstance(v, str) else json.dumps(v)) for k, v in flat(data).items()}


def flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        name = safe_name(f"{prefix}{k}")
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{name}."))
        else:
            out[name] = v
    return out


def safe_name(name: str) -> str:
    """A param, metric or tag name MLflow accepts (letters, digits, _ - . space / only)."""
    return re.sub(r"[^\w\-. /]", "_", name)[:250]


def clip(text: str) -> str:
    return text if len(text) <= MAX_VALUE else text[: MAX_VALUE - 1] + "…"


def one_line(text: str, width: int = 200) -> str:
    """text on one line; when longer than width, its start and its end, each cut at a space, joined by " … "
    (a client error ends in its cause: `... Failed to establish a new connection: [Errno 111] Connection refused`)."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    head, tail = text[: width * 2 // 3], text[-(width // 3):]
    return head.rsplit(" ", 1)[0] + " … " + tail.split(" ", 1)[-1]


def step_metrics(record: dict[str, Any]) -> list[tuple[str, float, int]]:
    """(name, value, step) of one history record: its numbers, named as TensorBoard names them
    (`<kind>/<field>`, stages/training/runlog.py)."""
    step = record.get("step")
    if not isinstance(step, int):
        return []
    kind = record.get("kind", "train")
    return [(safe_name(f"{kind}/{k}"), float(v), step) for k, v in record.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)]


# ------------------------------------------------------------------------------------------ the client thread
THREAD = "finetune-mlflow"


class QuietRetries(logging.Filter):
    """urllib3 logs each retry of a request as a warning; on the tracking thread the failure itself is the one
    line a run shows (Tracker._fail), so its retries are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != THREAD


_QUIET = QuietRetries()


class Tracker:
    """One MLflow run, fed from the run's thread(s) and sent from a thread of its own. Nothing here raises
    into the run: the first failure of the server is one warning, then every later call is dropped."""

    def __init__(self, s: Settings, run_name: str, tags: dict[str, str], parent: str | None = None):
        for k, v in CLIENT_ENV.items():
            os.environ.setdefault(k, v)
        logging.getLogger("urllib3.connectionpool").addFilter(_QUIET)  # adding it twice keeps one
        self.settings = s
        self.run_id: str | None = None
        self.url: str | None = None
        self.failed = False
        self.started = threading.Event()  # set once the run exists on the server, or creating it failed
        # per metric, the steps sent while the stage computed (a contiguous range: from its first step, or the
        # step it resumed after, to its last): a history file read afterwards adds only the steps outside it
        self._live: dict[str, tuple[int, int]] = {}
        self._metrics: list[tuple[str, float, int, int]] = []
        self._lock = threading.Lock()
        self._calls: queue.Queue[Callable[[Any], None] | None] = queue.Queue()
        self._client: Any = None
        all_tags = {**tags, **({"mlflow.parentRunId": parent} if parent else {})}
        self._thread = threading.Thread(target=self._loop, name=THREAD, daemon=True)
        self._thread.start()
        self.call(lambda c: self._create(c, run_name, all_tags))

    # --- called from the run
    def call(self, fn: Callable[[Any], None]) -> None:
        """fn(client) on the tracking thread, in order, once the run exists."""
        if not self.failed:
            self._calls.put(fn)

    def metrics(self, items: list[tuple[str, float, int]]) -> None:
        """(name, value, step) points, buffered: sent with the next batch."""
        now = int(time.time() * 1000)
        with self._lock:
            if not self.failed:
                self._metrics.extend((name, value, step, now) for name, value, step in items)

    def live(self, items: list[tuple[str, float, int]]) -> None:
        """Points of a record a computing stage just wrote (remembered: `was_live`)."""
        with self._lock:
            for name, _, step in items:
                lo, hi = self._live.get(name, (step, step))
                self._live[name] = (min(lo, step), max(hi, step))
        self.metrics(items)

    def was_live(self, name: str, step: int) -> bool:
        lo, hi = self._live.get(name, (1, 0))
        return lo <= step <= hi

    def params(self, values: dict[str, str]) -> None:
        items = list(values.items())

        def send(c: Any) -> None:
            from mlflow.entities import Param

            for i in range(0, len(items), PARAMS_PER_BATCH):
                c.log_batch(self.run_id, params=[Param(k, v) for k, v in items[i: i + PARAMS_PER_BATCH]])
        self.call(send)

    def tags(self, values: dict[str, str]) -> None:
        items = [(safe_name(k), clip(str(v))) for k, v in values.items()]

        def send(c: Any) -> None:
            from mlflow.entities import RunTag

            c.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in items])
        self.call(send)

    def artifact(self, path: Path, folder: str | None = None) -> None:
        self.call(lambda c: c.log_artifact(self.run_id, str(path), folder))

    def wait_started(self, timeout: float) -> str | None:
        """The run's id once the server made it (None: it failed, or did not answer within `timeout`)."""
        self.started.wait(timeout)
        return self.run_id

    def end(self, status: str = "FINISHED", wait_s: float = CLOSE_WAIT_S) -> None:
        """Send what is left and close the run (FINISHED / FAILED / KILLED), waiting at most wait_s."""
        self.call(lambda c: c.set_terminated(self.run_id, status))
        self._calls.put(None)
        self._thread.join(wait_s)
        if self._thread.is_alive():
            self._fail("tracking: MLflow at %s did not take this run's last records within %.0f s; the run ended "
                       "regardless (the store and the run record keep everything)", self.settings.uri, wait_s)

    # --- the tracking thread
    def _loop(self) -> None:
        """Each call in order, the buffered metrics sent before it (and every FLUSH_S seconds); None ends."""
        while True:
            try:
                fn = self._calls.get(timeout=FLUSH_S)
            except queue.Empty:
                fn = self._idle
            try:
                if not self.failed:
                    if self._client is None:
                        self._client = self._make_client()
                    self._flush()
                    if fn is not None:
                        fn(self._client)
            except Exception as e:  # noqa: BLE001  (whatever the client raises: the run goes on)
                self._give_up(e)
            if fn is None:
                return

    @staticmethod
    def _idle(client: Any) -> None:
        pass

    def _make_client(self) -> Any:
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.settings.uri)

    def _create(self, c: Any, run_name: str, tags: dict[str, str]) -> None:
        try:
            exp = c.get_experiment_by_name(self.settings.experiment)
            eid = exp.experiment_id if exp is not None else c.create_experiment(self.settings.experiment)
            run = c.create_run(eid, run_name=run_name,
                               tags={safe_name(k): clip(str(v)) for k, v in tags.items()})
            self.run_id = run.info.run_id
            base = self.settings.uri.rstrip("/")
            self.url = f"{base}/#/experiments/{eid}/runs/{self.run_id}" if base.startswith("http") else None
            log.info("tracking: MLflow run %s (%s)%s", run_name, self.run_id,
                     f" at {self.url}" if self.url else f" in {self.settings.uri}")
        finally:
            self.started.set()

    def _flush(self) -> None:
        if self.run_id is None or self.failed:
            return
        with self._lock:
            batch, self._metrics = self._metrics, []
        if not batch:
            return
        from mlflow.entities import Metric

        for i in range(0, len(batch), BATCH):
            self._client.log_batch(self.run_id, metrics=[Metric(n, v, t, s) for n, v, s, t in batch[i: i + BATCH]])

    def _give_up(self, e: BaseException) -> None:
        self._fail("tracking: MLflow at %s failed (%s: %s); this run goes on untracked, the store and the run "
                   "record keep everything (finetune inspect runs)", self.settings.uri, type(e).__name__,
                   one_line(str(e)))

    def _fail(self, message: str, *args: Any) -> None:
        """The one warning: every call after it is dropped."""
        with self._lock:
            if self.failed:
                return
            self.failed = True
            self._metrics.clear()
        self.started.set()
        log.warning(message, *args)


# ------------------------------------------------------------------------------------------ a pipeline run
class LiveRecords(logging.Handler):
    """Feeds the history records a computing stage writes (RECORDS_LOGGER) to the run's tracker."""

    def __init__(self, tracker: Tracker):
        super().__init__()
        self.tracker = tracker

    def emit(self, record: logging.LogRecord) -> None:
        rec = getattr(record, "record", None)
        if isinstance(rec, dict):
            self.tracker.live(step_metrics(rec))


class RunTracking:
    """The MLflow run of one pipeline run (stages/engine/runner.py's Execution): started with the run, fed each
    stage's outcome as it finishes, ended with the run."""

    def __init__(self, tracker: Tracker):
        self.tracker = tracker
        self.computed: list[str] = []
        self._live = LiveRecords(tracker)
        records = logging.getLogger(RECORDS_LOGGER)
        records.addHandler(self._live)
        if records.getEffectiveLevel() > logging.INFO:
            records.setLevel(logging.INFO)

    @classmethod
    def start(cls, cfg: PipelineConfig, tags: dict[str, str]) -> RunTracking | None:
        """None when tracking is off. A sweep's run (PARENT_ENV) nests under the sweep's run."""
        s = settings(cfg)
        if s is None:
            return None
        tags = {"finetune.pipeline": cfg.name, "finetune.set": json.dumps(list(cfg.overrides)),
                "finetune.precision": cfg.train.mixed_precision,  # as resolved for this machine (auto: why in train's tags)
                **({"finetune.sweep": os.environ[SWEEP_ENV]} if os.environ.get(SWEEP_ENV) else {}), **tags}
        tracker = Tracker(s, os.environ.get(RUN_NAME_ENV) or cfg.name, tags, os.environ.get(PARENT_ENV) or None)
        tracker.params(params(cfg))
        return cls(tracker)

    def stage(self, st: Stage, o: Outcome) -> None:
        """A finished stage: its key and status, its history and reported metrics, its tracked files."""
        status = outcome_status(o)
        if o.computed:
            self.computed.append(st.name)
        manifest = o.manifest or {}
        found = manifest.get("metrics")
        metrics: dict[str, Any] = found if isinstance(found, dict) else {}
        tags = {f"finetune.{st.name}.key": o.key, f"finetune.{st.name}.status": status}
        if st.reports:  # its short text metrics (train's precision and why) as tags, its numbers as metrics
            tags.update({f"finetune.{st.name}.{k}": v for k, v in metrics.items() if isinstance(v, str)})
        if st.produces_model and status != "joined":
            tags.update({"finetune.model_path": str(o.path), "finetune.model_key": o.key})
        self.tracker.tags(tags)
        if status == "joined":  # nothing of it on this machine
            return
        if st.history:  # what the live records did not send: a cached stage, a resumed run's earlier steps
            self.tracker.metrics([m for rec in read_metrics(o.path / st.history) for m in step_metrics(rec)
                                  if not self.tracker.was_live(m[0], m[2])])
        if st.reports:
            self.tracker.metrics([(safe_name(f"{st.name}.{k}"), float(v), 0) for k, v in scalars(metrics).items()])
        for pattern in st.tracked:
            for f in sorted(o.path.glob(pattern)):
                if f.is_file():
                    self.tracker.artifact(f, st.name)

    def end(self, status: str) -> None:
        logging.getLogger(RECORDS_LOGGER).removeHandler(self._live)
        self.tracker.tags({"finetune.cached": "false" if self.computed else "true",
                           "finetune.computed": ",".join(self.computed)})
        self.tracker.end(status)


class Tracking(Hook):
    """A run's MLflow run, as a hook: started with the run (when tracking is on), fed each finished stage
    (a cached one's files downloaded first from a shared store), ended with the run's status."""

    tracking: RunTracking | None = None

    def before_run(self, run: Run) -> None:
        self.tracking = RunTracking.start(run.plan.cfg, dict(run.tags))

    def after_stage(self, run: Run, outcome: Outcome) -> None:
        if self.tracking is None:
            return
        if not outcome.computed and outcome.reason != JOINED:  # its files are logged: here, downloaded
            run.store.materialize(outcome.stage, outcome.key, outcome.manifest.get("digest"))
        self.tracking.stage(run.plan.graph[outcome.stage], outcome)

    def after_run(self, run: Run, status: str) -> None:
        if self.tracking is not None:
            self.tracking.end(status)


# ------------------------------------------------------------------------------------------ a sweep
def start_sweep(cfg: PipelineConfig, name: str, definition: dict[str, Any]) -> Tracker | None:
    """The parent run of a sweep (its definition as params), or None when tracking is off for its pipeline."""
    s = settings(cfg)
    if s is None:
        return None
    tracker = Tracker(s, name, {"finetune.sweep": name, "finetune.kind": "sweep", "finetune.pipeline": cfg.name})
    tracker.params(param_values(definition))
    return tracker


def child_env(parent: Tracker | None, label: str, wait_s: float = 30.0) -> dict[str, str]:
    """The environment of a sweep's run: nested under the parent (once the server has made it), named by its
    variant, tracked whether or not the sweep was started with --track."""
    run_id = parent.wait_started(wait_s) if parent is not None else None
    return {RUN_NAME_ENV: label, PARENT_ENV: run_id, TRACK_ENV: "1"} if run_id else {}
