"""Test-session defaults: offline, the real data mirror, a fresh store per test, one Prefect server per worker."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Never touch the network from tests: the hub fails at once instead of retrying for a minute.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `-n 2` (pyproject): one torch thread per worker and per process a test starts; two workers with two
    # OpenMP threads each would oversubscribe 2 cores, and spinning threads wait on each other
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

# The CPU's bf16 units as none, so `train.mixed_precision: auto` trains in fp32 whatever CPU runs the suite (its
# tolerances are fp32's); tests of the detection inject capabilities (tests/stages/test_train.py).
os.environ.setdefault("FINETUNE_CPU_BF16_UNITS", "")

from helpers import SHARED_DATA, SHARED_FILES  # noqa: E402  (after the offline settings: helpers imports the stages)

os.environ.setdefault("FINETUNE_DATA_MIRROR", str(SHARED_DATA))


def pytest_configure(config: pytest.Config) -> None:
    """Under CI (CI=true, what .ci/run is given) a missing ../shared/data fails the run at once, in one line,
    instead of skipping the ~90 tests that need it; a local checkout without it still skips them."""
    missing = [f for f in SHARED_FILES if not (SHARED_DATA / f).exists()]
    if os.environ.get("CI", "").lower() in ("true", "1") and missing:
        raise pytest.UsageError(f"CI=true and the real data mirror lacks {SHARED_DATA}/{missing[0]}: put ../shared "
                                "beside the checkout (the tests that read it would otherwise be skipped)")


@pytest.fixture
def store_dir(tmp_path, monkeypatch) -> Path:
    """A fresh artifact store for this test (FINETUNE_STORE points at it)."""
    root = tmp_path / "store"
    monkeypatch.setenv("FINETUNE_STORE", str(root))
    return root


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """An S3 API on 127.0.0.1 (moto's server) for this test session, with bucket `finetune-test`; boto's
    standard settings (AWS_ENDPOINT_URL, dummy keys) point this process and its children at it."""
    from s3server import moto_server, s3_env

    with moto_server() as endpoint:
        saved = {k: os.environ.get(k) for k in s3_env(endpoint)}
        os.environ.update(s3_env(endpoint))
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir("finetune-test")
        try:
            yield endpoint
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> Iterator[str]:
    """One real `prefect server start` per test process (xdist worker), started by the first test that asks
    and shared by all the others (in-process flows, served deployments, command lines given its URL): each
    server start costs 12-30 s on two busy cores. Yields the API URL; this process's Prefect settings point
    at it from then on (what prefect_test_harness does, for the session). Tests that share it read back only
    their own flow runs (by id) or their own store; a test about the temporary server, or about a server's
    own home, starts its own."""
    from cluster import server
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    tmp = tmp_path_factory.mktemp("prefect-server")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp / "home"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               PREFECT_UI_ENABLED="false", PREFECT_SERVER_UI_ENABLED="false", PREFECT_SERVER_LOGGING_LEVEL="WARNING")
    with server(env, tmp) as api, temporary_settings({PREFECT_API_URL: api}), \
            _temporary_global_settings_context(get_settings_context()):
        yield api
        _drain_prefect_workers()  # this process's queued logs and events reach the server before it stops


def _drain_prefect_workers() -> None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        with contextlib.suppress(RuntimeError):  # never started
            if inspect.isawaitable(result := APILogWorker.instance().drain()):
                await result
        if inspect.isawaitable(result := EventsWorker.drain_all()):
            await result

    run_coro_as_sync(drain())
