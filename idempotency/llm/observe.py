"""The call layer's two observation points, for tracing installed from above (oncelery.tracing.otel).

A provider instrumentation (OpenLLMetry, a user's wrapper of the provider client) makes its `gen_ai` client span
around the client's request, inside the call layer: only there is its span the current one. So the wire calls
`on_request()` as a request leaves, and the call protocol says what it is about to do (`on_call`): a watcher set
for the step (`watching`) sees both. Nothing is watched unless tracing is on: each point is one ContextVar read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

__all__ = ["Watcher", "on_call", "on_request", "watching"]


class Watcher(Protocol):
    """What observes one model-call step: the requests it sends and the call protocol's choices."""

    def request(self) -> None:
        """Called as each request of the step leaves, in the context of whoever wraps the client's call."""
        ...

    def call(self, mode: str, reattached: bool, repeated: str | None) -> None:
        """Called before a create (`reattached` False) or before a re-attached call's first poll."""
        ...


_watcher: ContextVar[Watcher | None] = ContextVar("oncelery_llm_watcher", default=None)


@contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """Make `watcher` observe the model calls made in this context until the block exits."""
    token = _watcher.set(watcher)
    try:
        yield
    finally:
        _watcher.reset(token)


def on_request() -> None:
    """Tell the step's watcher (if any) that a request leaves now."""
    watcher = _watcher.get()
    if watcher is not None:
        watcher.request()


def on_call(mode: str, *, reattached: bool, repeated: str | None) -> None:
    """Tell the step's watcher (if any) what the protocol does next: a create, or a re-attach to a sent call."""
    watcher = _watcher.get()
    if watcher is not None:
        watcher.call(mode, reattached, repeated)
