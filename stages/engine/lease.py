"""A lease on a shared store: the lock that keeps two machines from computing one key at once.

The lease is one small object, created only if absent: on S3 a put with `If-None-Match: *`, which the
server refuses when the object exists, so of two machines racing exactly one wins. Its holder renews it
from a heartbeat thread every TTL/4; a lease not renewed for its TTL (default 120 s,
$FINETUNE_LEASE_TTL_S) belongs to a dead holder and is taken over, on S3 with a put conditional on the
stale object's ETag (`If-Match`), so of two machines taking over, again one wins. A live holder is never
taken over, however long its stage runs. Filesystems without conditional writes (memory://, a mounted
folder) get the same protocol without the server's guarantee: best effort.

Fencing: a holder that stalls past its TTL (a stopped process, a machine cut off from the store) has lost
the lease to the next run of its key, and must not write again. Every write under the lease is preceded by
`fence()`, a renewal conditional on the ETag of this holder's last one, which fails once anyone else has
written the lease object; and inside `stopping()` the heartbeat that finds the lease taken over stops the
holder's thread at once, raising `LeaseLost` there as Ctrl-C raises KeyboardInterrupt in the main thread
(CPython's `PyThreadState_SetAsyncExc`; a thread blocked in C gets it when it returns to Python). Either
way the holder ends on one LeaseLostError line that names who holds the key now.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from stages.engine.errors import LeaseLostError

log = logging.getLogger("finetune.store")
DEFAULT_TTL_S = 120.0
TAKEN = ".taken"  # beside a lease: who last took it over, and from whom


def lease_ttl_s() -> float:
    return float(os.environ.get("FINETUNE_LEASE_TTL_S") or DEFAULT_TTL_S)


def age_s(held: dict[str, Any]) -> float:
    """Seconds since a lease body (as read from the store) was last renewed."""
    return time.time() - float(held.get("renewed", 0))


def alive(held: dict[str, Any], ttl_s: float = 0.0) -> bool:
    """The lease body was renewed within its TTL (`ttl_s` when the body names none): its holder lives."""
    return age_s(held) <= float(held.get("ttl_s", ttl_s))


class LeaseLost(BaseException):
    """Raised in the thread that holds a lease its heartbeat found taken over (`Lease.stopping`); a
    BaseException, as KeyboardInterrupt is, so that no `except Exception` in a stage's body goes on past it."""


class Lease:
    """One lease object at `path` on fsspec filesystem `fs`: acquire() once, release() when done. `what`
    names the holder in the line a lost lease ends on (e.g. the stage)."""

    def __init__(self, fs: Any, path: str, ttl_s: float | None = None, what: str = "lease"):
        self.fs, self.path, self.what = fs, path, what
        self.ttl_s = ttl_s if ttl_s is not None else lease_ttl_s()
        self.owner = uuid.uuid4().hex
        self.conditional = "s3" in _protocols(fs)  # the server enforces If-None-Match / If-Match
        self._etag: str | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._renewing = threading.Lock()  # the heartbeat's renewals and fence()'s, one at a time
        self._renewed_at = time.monotonic()  # this holder's last renewal (the monotonic clock runs while stopped)
        self._armed = threading.Lock()  # guards `_target`: the thread `stopping` stops, None outside it
        self._target: int | None = None
        self._sent = False
        self.lost = False
        self.taken_by = ""
        self.stalled_s = 0.0

    def _body(self) -> bytes:
        return json.dumps({"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                           "renewed": time.time(), "ttl_s": self.ttl_s}).encode()

    def acquire(self) -> bool:
        """Take the lease if it is free or its holder died; True when this process now holds it."""
        try:
            self._put_new()
        except FileExistsError:
            if not self._take_over_stale():
                return False
        self._beat = threading.Thread(target=self._heartbeat, name=f"lease {self.path}", daemon=True)
        self._beat.start()
        return True

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if not self.lost and self._still_mine():
            try:
                self.fs.rm_file(self.path)
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------ the three writes
    def _put_new(self) -> None:
        out = self.fs.pipe_file(self.path, self._body(), mode="create")
        self._etag = _etag(out) or self._current_etag()
        self._renewed_at = time.monotonic()

    def _take_over_stale(self) -> bool:
        try:
            etag = self._current_etag()
            held = json.loads(self.fs.cat_file(self.path))
        except (FileNotFoundError, ValueError):
            return False  # released (or half-written) just now: try again at the next poll
        if alive(held, self.ttl_s):
            return False
        log.warning("lease %s was last renewed %.0f s ago by %s pid %s; its holder died, taking it over",
                    self.path, age_s(held), held.get("host"), held.get("pid"))
        if self.conditional:
            try:  # replace exactly the stale object we read: of two machines taking over, one wins
                self._etag = _etag(self.fs.pipe_file(self.path, self._body(), IfMatch=etag)) or None
            except OSError:
                return False
            self._etag = self._etag or self._current_etag()
        else:
            try:
                self.fs.rm_file(self.path)
                self._put_new()
            except (FileNotFoundError, FileExistsError):
                return False
        self._renewed_at = time.monotonic()
        with contextlib.suppress(OSError):  # for the holder it was taken from, should it wake: who took it
            self.fs.pipe_file(self.path + TAKEN, json.dumps({"from": held.get("owner"), "host": socket.gethostname(),
                                                             "pid": os.getpid(), "at": time.time()}).encode())
        return True

    def _renew(self) -> None:
        with self._renewing:
            if self.lost:
                return
            if self.conditional:
                try:
                    self._etag = _etag(self.fs.pipe_file(self.path, self._body(), IfMatch=self._etag)) \
                        or self._current_etag()
                    self._renewed_at = time.monotonic()
                    return
                except OSError:
                    if self._still_mine():
                        raise  # not a refused condition but a failed request: the heartbeat retries
            elif self._still_mine():
                self.fs.pipe_file(self.path, self._body())
                self._renewed_at = time.monotonic()
                return
            self.lost, self.taken_by = True, self._holder()
            self.stalled_s = time.monotonic() - self._renewed_at

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self._renew()
            except Exception as e:  # a network blip: try again at the next beat, before the TTL runs out
                log.warning("lease %s: renewal failed (%s); retrying", self.path, e)
            if self.lost:
                with self._armed:
                    if self._target is not None:  # stop the holder now: its line says why
                        self._sent = _raise_in(self._target, LeaseLost)
                        return
                log.error("lease %s was taken over by %s (not renewed within %.0f s)", self.path, self.taken_by,
                          self.ttl_s)
                return

    # ------------------------------------------------------------ fencing
    def fence(self) -> None:
        """Right before a write under the lease: renewed now, on S3 only if nobody else has written the lease
        object since this holder last did (If-Match its ETag). LeaseLostError, and nothing written, when
        another run took it over."""
        self._renew()
        if self.lost:
            raise LeaseLostError(self.lost_line())

    @contextlib.contextmanager
    def stopping(self) -> Iterator[None]:
        """While inside, the heartbeat that finds the lease taken over stops this thread at once: it ends in
        LeaseLostError (raised here as LeaseLost) wherever it is."""
        try:
            try:
                with self._armed:
                    self._target = threading.get_ident()
                yield
            finally:
                with self._armed:
                    if self._sent:  # sent but not raised yet (the body had just returned): withdrawn
                        _raise_in(self._target or 0, None)
                    self._target = None
        except LeaseLost:
            raise LeaseLostError(self.lost_line()) from None

    def lost_line(self) -> str:
        key = self.path.rsplit("/", 1)[-1].removesuffix(".lock")[:12]
        return (f"{self.what}: {self.taken_by} took over the lease on key {key} after this run went "
                f"{self.stalled_s:.0f} s without renewing it (its TTL is {self.ttl_s:.0f} s, $FINETUNE_LEASE_TTL_S: "
                f"this process was stopped or cut off from the store); this run stopped without writing anything "
                f"more of it. That run computes the key: rerun to reuse its artifact")

    # ------------------------------------------------------------ reading
    def _current_etag(self) -> str | None:
        self.fs.invalidate_cache(self.path)
        return self.fs.info(self.path).get("ETag")

    def _holder(self) -> str:
        """Who took the lease from this holder (holds it now, or held it since), for people."""
        for path in (self.path + TAKEN, self.path):
            try:
                held = json.loads(self.fs.cat_file(path))
            except (OSError, ValueError):
                continue
            if held.get("from", self.owner) == self.owner and held.get("owner") != self.owner:
                return f"another run (host {held.get('host')} pid {held.get('pid')})"
        return "another run"

    def _still_mine(self) -> bool:
        try:
            return json.loads(self.fs.cat_file(self.path)).get("owner") == self.owner
        except (FileNotFoundError, ValueError):
            return False


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> bool:
    """Raise `exc` in thread `thread_id` at its next Python instruction (None: withdraw one not raised yet)."""
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                                      ctypes.py_object(exc) if exc else None) == 1


def _etag(put_response: Any) -> str | None:
    return put_response.get("ETag") if isinstance(put_response, dict) else None


class KeysLease(Lease):
    """A lease that also lists (stage, key)s: a live run's plan, which gc on any machine spares."""

    def __init__(self, fs: Any, path: str, keys: list[tuple[str, str]], ttl_s: float | None = None):
        super().__init__(fs, path, ttl_s)
        self.keys = [list(k) for k in keys]

    def _body(self) -> bytes:
        return json.dumps({**json.loads(super()._body()), "keys": self.keys}).encode()
