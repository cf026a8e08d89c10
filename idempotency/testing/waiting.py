"""How the kit waits: on an observable condition, with a bound, never a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

__all__ = [
    "DEFAULT_TIMEOUT",
    "poll",
    "wait_until",
]

DEFAULT_TIMEOUT = 60.0  # seconds any helper waits for an observable condition before failing the test


def poll(condition: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll `condition` until it returns a truthy value (returned) or `timeout` seconds pass (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)


def wait_until(
    condition: Callable[[], Any], timeout: float = DEFAULT_TIMEOUT, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll `condition` until it returns a truthy value (returned), or fail the test after `timeout` seconds."""
    value = poll(condition, timeout, interval)
    if not value:
        pytest.fail(f"timed out after {timeout}s waiting for {what or condition}")
    return value
