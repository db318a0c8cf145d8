"""Headless Chromium (Debian's package) driven through the DevTools protocol over a pipe
(`--remote-debugging-pipe`: JSON messages, each ended by a NUL byte, written to its fd 3 and read from its fd 4): no
websocket library, no playwright. Enough to open a page, wait for a condition, read the DOM and take a screenshot."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, profile: Path, width: int = 1280, height: int = 800):
        assert CHROMIUM is not None
        to_child, self._w = os.pipe()
        self._r, from_child = os.pipe()

        def fds() -> None:  # in the child: the pipes' ends at fd 3 and 4 (copies first: either may be 3 or 4)
            a, b = os.dup(to_child), os.dup(from_child)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             f"--user-data-dir={profile}", f"--window-size={width},{height}", "--remote-debugging-pipe",
             "about:blank"],
            pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=fds)
        os.close(to_child)
        os.close(from_child)
        self._next, self._buf = 0, b""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buf:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium closed the pipe (exit {self.proc.poll()})")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def open(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)

    def evaluate(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        return r.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 120) -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if value := self.evaluate(expression):
                return value
            time.sleep(0.2)
        raise TimeoutError(f"{expression} stayed false for {timeout} s")

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", session=True, format="png")["data"]))
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, OSError):
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)
