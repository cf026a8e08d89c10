"""The fake provider's lifecycle: its HTTP server, run in a thread of this process (`FakeProvider`) or as the
process itself (`serve`, for `python -m oncelery.fake_provider`).

The routes are `handler`'s (with `batch_routes` and `exchange` below it); `FakeProviderControl` (`control`) drives
a running fake over HTTP, and `FakeProvider` is one with the thread and the state in hand.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any

from oncelery.fake_provider.batches import FakeBatches
from oncelery.fake_provider.control import FakeProviderControl
from oncelery.fake_provider.generate import Generator, default_generator
from oncelery.fake_provider.handler import Handler
from oncelery.fake_provider.state import Knobs, ProviderState

# `FakeProviderControl` was defined here before `control` held it: it stays importable from here.
__all__ = ["FakeProvider", "FakeProviderControl", "ProviderServer", "serve"]

SHUTDOWN_POLL_S = 0.02  # how often the threaded server looks for a shutdown request


class ProviderServer(ThreadingHTTPServer):
    """The fake's HTTP server: one `Handler` thread per connection over one `ProviderState` and its batches."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], state: ProviderState, generator: Generator) -> None:
        super().__init__(address, Handler)
        self.state = state
        self.generator = generator
        self.batches = FakeBatches(state, generator)
        self.stopping = threading.Event()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Stay quiet when a client vanished (a killed worker resets its connections); report anything else."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeProvider(FakeProviderControl):
    """A fake provider served from a thread of this process on 127.0.0.1; a context manager that stops it."""

    def __init__(self, knobs: Knobs | None = None, generator: Generator | None = None, port: int = 0) -> None:
        self.state = ProviderState(knobs)
        self._server = ProviderServer(("127.0.0.1", port), self.state, generator or default_generator)
        self.port = int(self._server.server_address[1])
        super().__init__(f"http://127.0.0.1:{self.port}")
        # A short poll interval: `stop` (shutdown) waits for it, 0.5 s by default, at every test's teardown.
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(SHUTDOWN_POLL_S,), name="oncelery-fake-provider", daemon=True
        )

    @property
    def openai_base_url(self) -> str:
        """Return the base URL an OpenAI client takes (`.../v1`)."""
        return self.url + "/v1"

    @property
    def gemini_base_url(self) -> str:
        """Return the base URL a Gemini client takes (`.../v1beta`)."""
        return self.url + "/v1beta"

    def start(self) -> FakeProvider:
        """Start serving; return self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket; held and streaming answers end at once."""
        self._server.stopping.set()
        self.state.release()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FakeProvider:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(host: str, port: int, knobs: Knobs, ready: Callable[[str], None]) -> None:
    """Serve a fake provider in this thread until interrupted; call `ready(url)` once it listens."""
    server = ProviderServer((host, port), ProviderState(knobs), default_generator)
    ready(f"http://{host}:{server.server_address[1]}")
    try:
        server.serve_forever()
    finally:
        server.stopping.set()
        server.server_close()
