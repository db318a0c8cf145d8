"""Workarounds for third-party libraries, one module per library, each pinned to internals of the versions
it names in `WRITTEN_FOR`. tests/common/test_compat.py fails when an installed version leaves that range or
a patched target is gone, naming the workaround to revisit."""
