"""xdist's file scheduling (`--dist loadfile`, pyproject.toml) made safe for a worker that dies: a native crash
(SIGILL, SIGSEGV) in a test fails that test and the suite goes on, then ends. tests/conftest.py installs it.

xdist 3.8's LoadFileScheduling, when a worker dies, puts the dead worker's files back in the queue with the test
that crashed still pending, so the replacement worker runs it again (and dies again), and it hands the
replacement a single file with a single test left: a worker runs its last test only once it knows what follows
(more tests or a shutdown), and none ever comes, so the controller and the workers wait on each other for ever.
Here the crashed test counts as done (xdist reports it failed: "worker 'gwN' crashed while running ..."), and a
worker is always given a second test or told to shut down. tests/test_suite_faults.py proves it."""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadFileScheduling


class CrashSafeLoadFile(LoadFileScheduling):
    def remove_node(self, node: Any) -> str | None:
        workload = self.assigned_work.get(node, {})
        crashed = next((nodeid for unit in workload.values() for nodeid, done in unit.items() if not done), None)
        for unit in workload.values():
            if crashed in unit:
                unit[crashed] = True
        super().remove_node(node)
        return crashed

    def _reschedule(self, node: Any) -> None:
        super()._reschedule(node)
        while not node.shutting_down and self._pending_of(self.assigned_work[node]) < 2:
            super()._reschedule(node)  # one more file, or the shutdown that lets the worker run its last test


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    if config.getvalue("dist") == "loadfile":
        return CrashSafeLoadFile(config, log)
    return None
