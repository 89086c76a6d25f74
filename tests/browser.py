"""A real headless Chromium for tests, driven over the DevTools protocol on a pipe (stdlib only).

    with Browser() as browser:
        page = browser.open(Path("report.html"))
        page.evaluate("document.title"); page.screenshot(Path("shot.png")); page.errors

`chromium_path()` finds Debian's `chromium`, installing the package when it is missing and this
process may (root with apt-get); None when it cannot be had, so a test can skip with the reason.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

INSTALL_TIMEOUT_S = 900
COMMAND_TIMEOUT_S = 60


def chromium_path() -> tuple[str | None, str]:
    """The browser's path (installing Debian's package if missing and possible), or None and why."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name), ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "no chromium, and apt-get cannot install it here (not root, or no apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        if done.returncode != 0:
            return None, f"`{' '.join(cmd)}` failed: {done.stderr.strip().splitlines()[-1:]}"
    path = shutil.which("chromium")
    return (path, "") if path else (None, "apt-get installed chromium but it is not on PATH")


class Page:
    """One tab: evaluate JavaScript, take screenshots; `errors` collects console errors and exceptions."""

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser, self.session = browser, session
        self.errors: list[str] = []

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        return self.browser.send(method, params, session=self.session, page=self)

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))


class Browser:
    def __init__(self, executable: str | None = None, width: int = 1400, height: int = 1000) -> None:
        self.executable = executable or chromium_path()[0]
        if self.executable is None:
            raise RuntimeError("no chromium")
        self.size = (width, height)
        self._next_id = 0
        self._buffer = b""

    def __enter__(self) -> Browser:
        self._profile = tempfile.mkdtemp(prefix="hetplan-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        def as_fds_3_and_4() -> None:    # the browser reads commands on fd 3 and writes replies on fd 4
            read_end, write_end = os.dup(to_browser_r), os.dup(from_browser_w)   # neither is 3 or 4 now
            os.dup2(read_end, 3)
            os.dup2(write_end, 4)

        self.process = subprocess.Popen(
            [self.executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             f"--user-data-dir={self._profile}", f"--window-size={self.size[0]},{self.size[1]}",
             "--no-first-run", "--disable-extensions", "about:blank"],
            pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=as_fds_3_and_4)
        os.close(to_browser_r)
        os.close(from_browser_w)
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.kill()
        self.process.wait(timeout=30)
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self._profile, ignore_errors=True)

    def send(self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None,
             page: Page | None = None) -> dict[str, Any]:
        """One command; events that arrive meanwhile are given to `page` (console errors)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while time.monotonic() < deadline:
            reply = self._read()
            if page is not None:
                page.errors.extend(_error_of(reply))
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
        raise TimeoutError(f"{method}: no reply in {COMMAND_TIMEOUT_S} s")

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("the browser closed its pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def open(self, path: Path, settle_s: float = 0.5) -> Page:
        """Open a local file in a new tab, with console errors and exceptions recorded, once loaded."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        for domain in ("Page", "Runtime", "Log"):
            page.send(f"{domain}.enable")
        page.send("Emulation.setDeviceMetricsOverride", width=self.size[0], height=self.size[1],
                  deviceScaleFactor=1, mobile=False)
        page.send("Page.navigate", url=path.resolve().as_uri())
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while page.evaluate("document.readyState") != "complete" and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(settle_s)
        page.evaluate("0")      # collect the events that came while it settled
        return page


def _error_of(message: dict[str, Any]) -> list[str]:
    method, params = message.get("method"), message.get("params", {})
    if method == "Runtime.exceptionThrown":
        return [str(params.get("exceptionDetails", {}).get("text", params))]
    if method == "Runtime.consoleAPICalled" and params.get("type") == "error":
        return [" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))]
    if method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
        return [str(params["entry"].get("text", ""))]
    return []
