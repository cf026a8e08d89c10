"""Kept arguments: what a run keeps of its message after completion (the task's `keep_arguments=`), and how
the CLI shows it without printing it.

A fork needs the arguments of the run it forks, which completion clears (G9). A task that opts in keeps them in
`task_runs.message` until retention clears them (`oncelery_kept_arguments_retention`, default 7d after the run
finished; `oncelery purge` and the relay apply it). They are payload at rest: the CLI never prints their values
unless asked (`--show-arguments`); it prints each argument's name, size and a keyed digest instead
(`redact_arguments`). Any other payload kept at rest (e.g. a debounced call's latest arguments) uses the same helper.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

__all__ = [
    "arguments_of",
    "redact_arguments",
]


def arguments_of(message: Any) -> tuple[list[Any], dict[str, Any]] | None:
    """The (args, kwargs) a stored message holds, or None when it keeps none (JSON null, cleared)."""
    if not isinstance(message, dict) or ("args" not in message and "kwargs" not in message):
        return None
    return list(message.get("args") or []), dict(message.get("kwargs") or {})


def _shown(value: Any, key: bytes | None) -> dict[str, Any]:
    encoded = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()
    # Keyed (HMAC) where a key exists: a plain hash of a low-entropy value (a user id, a yes/no) is reversible.
    digest = hmac.new(key, encoded, hashlib.sha256) if key else hashlib.sha256(encoded)
    return {"type": type(value).__name__, "bytes": len(encoded), "digest": digest.hexdigest()[:16]}


def redact_arguments(message: Any, key: bytes | None = None) -> dict[str, Any]:
    """Describe a stored message's arguments without their values: name (or position), type, size, keyed digest.

    Never raises on a message of another shape (it then describes nothing); `key`: the deployment's digest key
    (the claims database's secret), so equal values can be compared across runs but not guessed.
    """
    found = arguments_of(message)
    if found is None:
        return {"kept": False}
    args, kwargs = found
    return {
        "kept": True,
        "args": [_shown(value, key) for value in args],
        "kwargs": {name: _shown(value, key) for name, value in sorted(kwargs.items())},
    }
