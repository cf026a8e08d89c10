"""`FakeProviderControl`: a client of the fake's `/_fake/*` control API, for a fake run as a thread or a process."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any


class FakeProviderControl:
    """Drives a running fake provider (thread or process) over its `/_fake/*` API; every call is bounded."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("content-type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise ValueError(exc.read().decode(errors="replace")) from None

    def stats(self) -> dict[str, Any]:
        """Return the fake's counters now (creates, creates_by_intent, polls, errors_served, held...)."""
        return dict(self._call("GET", "/_fake/stats"))

    def set_knobs(self, **knobs: Any) -> dict[str, Any]:
        """Change knobs (see `Knobs`), all or none; return every knob's value."""
        return dict(self._call("POST", "/_fake/knobs", knobs))

    def release(self) -> int:
        """Release every held create answer and every batch held by `batch_hold`; return how many answers were held."""
        return int(self._call("POST", "/_fake/release", {})["released"])

    def forget(self, call_id: str | None = None) -> int:
        """Drop a call (or all of them), as a provider past its retention does; its retrieve answers 404."""
        return int(self._call("POST", "/_fake/forget", {} if call_id is None else {"id": call_id})["forgotten"])

    def reset(self) -> None:
        """Forget every call and counter; restore the default knobs."""
        self._call("POST", "/_fake/reset", {})

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> dict[str, Any]:
        """Poll the counters until `predicate(stats)` holds; return them, or raise TimeoutError with the last."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if predicate(stats):
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fake provider's counters did not reach the condition in {timeout}s: {stats}")
            time.sleep(0.02)
