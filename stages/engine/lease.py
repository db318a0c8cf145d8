"""A lease on a shared store: the lock that keeps two machines from computing one key at once.

The lease is one small object, created only if absent: on S3 a put with `If-None-Match: *`, which the
server refuses when the object exists, so of two machines racing exactly one wins. Its holder renews it
from a heartbeat thread every TTL/4; a lease not renewed for its TTL (default 120 s,
$FINETUNE_LEASE_TTL_S) belongs to a dead holder and is taken over, on S3 with a put conditional on the
stale object's ETag (`If-Match`), so of two machines taking over, again one wins. A live holder is never
taken over, however long its stage runs. Filesystems without conditional writes (memory://, a mounted
folder) get the same protocol without the server's guarantee: best effort.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

log = logging.getLogger("finetune.store")
DEFAULT_TTL_S = 120.0


def lease_ttl_s() -> float:
    return float(os.environ.get("FINETUNE_LEASE_TTL_S") or DEFAULT_TTL_S)


def age_s(held: dict[str, Any]) -> float:
    """Seconds since a lease body (as read from the store) was last renewed."""
    return time.time() - float(held.get("renewed", 0))


def alive(held: dict[str, Any], ttl_s: float = 0.0) -> bool:
    """The lease body was renewed within its TTL (`ttl_s` when the body names none): its holder lives."""
    return age_s(held) <= float(held.get("ttl_s", ttl_s))


class Lease:
    """One lease object at `path` on fsspec filesystem `fs`: acquire() once, release() when done."""

    def __init__(self, fs: Any, path: str, ttl_s: float | None = None):
        self.fs, self.path = fs, path
        self.ttl_s = ttl_s if ttl_s is not None else lease_ttl_s()
        self.owner = uuid.uuid4().hex
        self.conditional = "s3" in _protocols(fs)  # the server enforces If-None-Match / If-Match
        self._etag: str | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.lost = False

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
            return True
        try:
            self.fs.rm_file(self.path)
            self._put_new()
        except (FileNotFoundError, FileExistsError):
            return False
        return True

    def _renew(self) -> None:
        if self.conditional:
            try:
                self._etag = _etag(self.fs.pipe_file(self.path, self._body(), IfMatch=self._etag)) \
                    or self._current_etag()
                return
            except OSError:
                if self._still_mine():
                    raise  # not a refused condition but a failed request: the heartbeat retries
        elif self._still_mine():
            self.fs.pipe_file(self.path, self._body())
            return
        self.lost = True
        log.error("lease %s was taken over by another machine (not renewed within %.0f s)", self.path,
                  self.ttl_s)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self._renew()
            except Exception as e:  # a network blip: try again at the next beat, before the TTL runs out
                log.warning("lease %s: renewal failed (%s); retrying", self.path, e)
            if self.lost:
                return

    # ------------------------------------------------------------ reading
    def _current_etag(self) -> str | None:
        self.fs.invalidate_cache(self.path)
        return self.fs.info(self.path).get("ETag")

    def _still_mine(self) -> bool:
        try:
            return json.loads(self.fs.cat_file(self.path)).get("owner") == self.owner
        except (FileNotFoundError, ValueError):
            return False


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _etag(put_response: Any) -> str | None:
    return put_response.get("ETag") if isinstance(put_response, dict) else None


class KeysLease(Lease):
    """A lease that also lists (stage, key)s: a live run's plan, which gc on any machine spares."""

    def __init__(self, fs: Any, path: str, keys: list[tuple[str, str]], ttl_s: float | None = None):
        super().__init__(fs, path, ttl_s)
        self.keys = [list(k) for k in keys]

    def _body(self) -> bytes:
        return json.dumps({**json.loads(super()._body()), "keys": self.keys}).encode()
