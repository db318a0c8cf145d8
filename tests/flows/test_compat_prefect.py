"""Every Prefect workaround (flows/orchestration/compat_prefect.py) still has its target in the installed Prefect,
and the Prefect version pinned in pyproject.toml is one each was written for: an upgrade that moves the pin
out of a range, or removes what a workaround patches, fails here by name instead of at a user's Ctrl-C."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from importlib.metadata import version

import pytest
from helpers import ROOT
from packaging.specifiers import SpecifierSet

from flows.orchestration import compat_prefect
from flows.orchestration.compat_prefect import WORKAROUNDS


def pinned_prefect() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(re.fullmatch(r"prefect==(\S+)", d).group(1) for d in deps if d.startswith("prefect=="))


@pytest.mark.parametrize("w", WORKAROUNDS, ids=lambda w: w.name)
def test_each_workaround_was_written_for_the_pinned_and_installed_prefect(w):
    for what, v in (("pinned in pyproject.toml", pinned_prefect()), ("installed", version("prefect"))):
        assert v in SpecifierSet(w.versions), (
            f"prefect {v} ({what}) is outside {w.versions}, the versions the workaround '{w.name}' was written "
            f"for ({w.why}). Check it against the new Prefect, then widen its range in compat_prefect.py")


@pytest.mark.parametrize("w", WORKAROUNDS, ids=lambda w: w.name)
def test_each_workaround_target_still_exists(w):
    assert not w.missing(), (f"the workaround '{w.name}' (written for prefect {w.versions}) patches "
                             f"{', '.join(w.missing())}, which prefect {version('prefect')} no longer has")


def test_a_gone_target_is_reported():
    gone = compat_prefect.Workaround("x", ">=3", "prefect.runner", ("Runner.no_such_method",), "test")
    assert gone.missing() == ["prefect.runner.Runner.no_such_method"]
    assert compat_prefect.Workaround("x", ">=3", "prefect.no_such_module", (), "test").missing() == \
        ["prefect.no_such_module"]


def test_the_temporary_server_starts_in_its_own_session(monkeypatch):
    import prefect.server.api.server as server

    monkeypatch.setattr(server, "subprocess", server.subprocess)  # restored after the test
    compat_prefect.start_temporary_server_in_own_session()
    proc = server.subprocess.Popen(["sleep", "5"])
    try:
        assert os.getsid(proc.pid) == proc.pid != os.getsid(0)
        assert server.subprocess.TimeoutExpired is subprocess.TimeoutExpired
    finally:
        proc.kill()
        proc.wait()


def test_the_serve_runner_hands_sigterm_to_our_handler():
    calls = []
    runner = compat_prefect.runner_with_sigterm_handler(lambda: calls.append(1), limit=1)
    runner.handle_sigterm()
    assert calls == [1] and not compat_prefect.runner_is_serving(runner)
    assert compat_prefect.runner_processes(runner) == []



def test_the_temporary_servers_start_is_one_line_without_advice(caplog):
    import prefect.server.api.server as server

    compat_prefect.quiet_temporary_server_hint()
    compat_prefect.quiet_temporary_server_hint()  # idempotent: one filter
    logger = server.subprocess_server_logger
    assert sum(isinstance(f, compat_prefect._FirstLineOfServerStart) for f in logger.filters) == 1
    with caplog.at_level("INFO", logger=logger.name):
        logger.info("Starting temporary server on http://127.0.0.1:8000\nSee https://www.prefect.io/docs/v3/"
                    "concepts/server#how-to-guides for more information on running a dedicated Prefect server.")
        logger.info("another line\nSee https://example.org")  # any other record is left as it is
    assert [r.getMessage() for r in caplog.records] == ["Starting temporary server on http://127.0.0.1:8000",
                                                       "another line\nSee https://example.org"]


def test_a_run_its_runner_cancelled_does_not_finish_in_state_running():
    """CANCELLED_BY_RUNNER: the engine's closing line after `Flow run was cancelled.` says who sets the final
    state; the same line without a cancellation before it is left alone."""
    import logging

    def line(filt, msg):
        record = logging.LogRecord("prefect.flow_runs", logging.INFO, __file__, 1, msg, (), None)
        assert filt.filter(record)
        return record.getMessage()

    filt = compat_prefect._CancelledByRunner()
    assert line(filt, "Finished in state Running()") == "Finished in state Running()"
    assert line(filt, "Flow run was cancelled.") == "Flow run was cancelled."
    assert line(filt, "Finished in state Running()") == compat_prefect.CANCELLED_LINE
    compat_prefect.say_who_cancelled()
    compat_prefect.say_who_cancelled()
    assert sum(isinstance(f, compat_prefect._CancelledByRunner)
               for f in logging.getLogger("prefect.flow_runs").filters) == 1


def test_a_failed_states_line_has_no_empty_traceback_and_an_exception_keeps_its_own(monkeypatch):
    import io
    import logging

    compat_prefect.no_empty_tracebacks()
    logger, out = logging.getLogger("prefect.task_runs"), io.StringIO()
    monkeypatch.setattr(logger, "propagate", False)  # to this handler only, not Prefect's API handler
    monkeypatch.setattr(logger, "handlers", [])
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    try:
        logger.error("Task run failed with state: Failed('StoreUnavailableError: ...')", exc_info=True)
        try:
            raise ValueError("a real one")
        except ValueError:
            logger.error("Task run failed with exception", exc_info=True)
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert "NoneType: None" not in text
    assert text.startswith("Task run failed with state: Failed('StoreUnavailableError: ...')\nTask run failed with "
                           "exception\nTraceback (most recent call last):") and "ValueError: a real one" in text
