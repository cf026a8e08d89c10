"""A real headless Chromium (Debian's) driven over the DevTools protocol: load pages, click, fill forms, read the DOM.

`--dump-dom` (tests/test_flower.py) loads one page and cannot click; a page's own form and button need a browser
that stays open. This one speaks CDP over Tornado's websocket client (Tornado comes with Flower, so no extra
package), one Chromium for a whole test: each load waits for the page's `load` event.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from tornado.websocket import WebSocketClientConnection, websocket_connect

LOAD_TIMEOUT = 30.0


class Browser:
    """One headless Chromium page: `open(url)`, `click(css)`, `fill(css, text)`, `dom()`, `screenshot(path)`."""

    def __init__(self, tmp_path: Path, headers: dict[str, str] | None = None, width: int = 1600) -> None:
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        if exe is None:
            if os.environ.get("CI"):
                pytest.fail("Debian's chromium is missing: .ci/run installs it (apt-get install chromium)")
            pytest.skip("headless Chromium is not installed (apt-get install chromium)")
        profile = tmp_path / f"chromium-cdp-{os.getpid()}-{time.monotonic_ns()}"
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                 "--remote-debugging-port=0", f"--window-size={width},1000", "about:blank"]  # fmt: skip
        self.process = subprocess.Popen([exe, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.loop = asyncio.new_event_loop()
        self.ids = 0
        self.events: list[dict[str, Any]] = []
        try:
            self.ws: WebSocketClientConnection = self.loop.run_until_complete(self._connect(profile))
            self.call("Page.enable")
            self.call("Runtime.enable")
            if headers:  # e.g. Flower's basic auth, sent with every request the page makes (its form posts too)
                self.call("Network.enable")
                self.call("Network.setExtraHTTPHeaders", headers=headers)
        except BaseException:
            self.close()
            raise

    async def _connect(self, profile: Path) -> WebSocketClientConnection:
        deadline = time.monotonic() + LOAD_TIMEOUT
        active = profile / "DevToolsActivePort"  # Chromium writes its port here once it listens
        while not active.exists() or not active.read_text().strip():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError("Chromium did not open its DevTools port")
            await asyncio.sleep(0.05)
        port = active.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
            pages = [t for t in json.loads(resp.read()) if t["type"] == "page"]
        return await websocket_connect(pages[0]["webSocketDebuggerUrl"], max_message_size=1 << 28)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result (events that arrive meanwhile are kept)."""
        return self.loop.run_until_complete(self._call(method, params))

    async def _call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.ids += 1
        await self.ws.write_message(json.dumps({"id": self.ids, "method": method, "params": params}))
        while True:
            message = await asyncio.wait_for(self.ws.read_message(), LOAD_TIMEOUT)
            if message is None:
                raise RuntimeError("Chromium closed the DevTools connection")
            data = json.loads(message)
            if data.get("id") == self.ids:
                if "error" in data:
                    raise RuntimeError(f"{method}: {data['error']}")
                return dict(data.get("result") or {})
            self.events.append(data)

    def _wait_load(self) -> None:
        async def wait() -> None:
            while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
                message = await asyncio.wait_for(self.ws.read_message(), LOAD_TIMEOUT)
                if message is None:
                    raise RuntimeError("Chromium closed the DevTools connection")
                self.events.append(json.loads(message))

        self.loop.run_until_complete(wait())

    def open(self, url: str) -> str:
        """Load `url` and return its DOM once the page's load event fired."""
        self.events.clear()
        self.call("Page.navigate", url=url)
        self._wait_load()
        return self.dom()

    def click(self, selector: str) -> str:
        """Click the element `selector` (a link or a submit button) and return the DOM of the page it loads."""
        self.events.clear()
        self.evaluate(f"document.querySelector({json.dumps(selector)}).click()")
        self._wait_load()
        return self.dom()

    def fill(self, selector: str, value: str) -> None:
        """Set the value of the form field `selector` (an input, a textarea or a select)."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).value = {json.dumps(value)}")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def dom(self) -> str:
        """The page's DOM as HTML."""
        return str(self.evaluate("document.documentElement.outerHTML"))

    def text(self) -> str:
        """The page's visible text."""
        return str(self.evaluate("document.body.innerText"))

    def screenshot(self, path: Path) -> None:
        """Save the whole page (beyond the window's height) as a PNG at `path`."""
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True, clip=clip)
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        """Close the connection and stop Chromium."""
        ws = getattr(self, "ws", None)
        try:
            if ws is not None:
                # Closed on its own loop: outside it, tornado asks asyncio for the current loop, which an earlier
                # test of the session (asyncio.run) may have left unset: "There is no current event loop".
                self.loop.run_until_complete(self._close(ws))
        finally:  # Chromium is stopped and waited for whatever the close did: no process outlives the test
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
            self.loop.close()

    @staticmethod
    async def _close(ws: WebSocketClientConnection) -> None:
        ws.close()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
