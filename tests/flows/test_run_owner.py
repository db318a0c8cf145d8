"""Whose is a flow run: the owner label names a process that is there, gone, or on another host."""

from __future__ import annotations

import socket
import subprocess
import sys

from flows.orchestration.run_owner import owner_is_gone, owner_of_this_process


def test_an_owner_is_gone_only_when_its_process_on_this_host_is():
    assert not owner_is_gone(owner_of_this_process())
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    host = socket.gethostname()
    assert owner_is_gone(f"{host}:{dead_pid}:12345")
    pid, start = owner_of_this_process().rsplit(":", 2)[1:]
    assert owner_is_gone(f"{host}:{pid}:{int(start) - 100}")  # the same PID, another process (started earlier)
    assert not owner_is_gone(f"another-host:{dead_pid}:12345")  # that host's next run decides
    assert not owner_is_gone("not an owner label")
