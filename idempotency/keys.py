"""Idempotency keys from business data and payload fingerprints (canonical JSON, sha256)."""

from __future__ import annotations

import hashlib
import inspect
import json
import string
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oncelery.errors import ConfigurationError, InvalidKey, PayloadNotJSON
from oncelery.settings import MAX_KEY_LENGTH

KeySpec = str | Callable[..., str] | None
FingerprintSpec = Sequence[str] | None


def canonical_json(value: Any) -> str:
    """Encode `value` as canonical JSON (sorted keys, no spaces, no NaN), raising PayloadNotJSON if it can't."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PayloadNotJSON(
            f"Cannot fingerprint a non-JSON value ({exc}); pass JSON types (str, int, float, bool, None, "
            f"list, dict) as task arguments",
        ) from exc


def sha256_hex(text: str) -> str:
    """Return the hex sha256 of `text` encoded as UTF-8 (stable across processes, unlike hash())."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def validate_key(key: Any) -> str:
    """Return `key` if it is a non-empty str of at most 255 chars without control characters, else raise."""
    if not isinstance(key, str) or not key:
        raise InvalidKey(f"An idempotency key must be a non-empty string, got {key!r}", key=repr(key))
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(
            f"Idempotency key is {len(key)} characters, the limit is {MAX_KEY_LENGTH}: "
            f"derive a shorter key (e.g. hash the long part): {key[:60]!r}...",
            key=key[:MAX_KEY_LENGTH],
        )
    bad = [ch for ch in key if unicodedata.category(ch) == "Cc"]
    if bad:
        raise InvalidKey(
            f"Idempotency key {key!r} contains control characters {bad!r}: use printable characters only",
            key=key,
        )
    return key


@dataclass(frozen=True)
class Identity:
    """What the claim engine needs about one call: its key, payload fingerprint and per-field digests."""

    key: str
    fingerprint: str
    field_digests: dict[str, str]


class KeyBuilder:
    """Derives keys and fingerprints for one task's signature; validates its options at decoration time."""

    def __init__(self, func: Callable[..., Any], task_name: str, key: KeySpec, fields: FingerprintSpec):
        self.task_name = task_name
        self.signature = inspect.signature(func)
        self.key_spec = key
        params = list(self.signature.parameters)
        if fields is not None:
            if isinstance(fields, str):
                fields = (fields,)
            unknown = [f for f in fields if f not in params]
            if unknown:
                raise ConfigurationError(
                    f"{task_name}: fingerprint names {unknown} that are not parameters of the task {params}"
                )
        self.fields: tuple[str, ...] | None = tuple(fields) if fields is not None else None
        if isinstance(key, str):
            names = {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(key) if name}
            unknown = sorted(n for n in names if n not in params)
            if unknown or any(n == "" or n.isdigit() for n in names):
                raise ConfigurationError(
                    f"{task_name}: idempotency_key template {key!r} names {unknown or names} which are not "
                    f"parameters of the task {params}; use {{param}} placeholders"
                )
        elif key is not None and not callable(key):
            raise ConfigurationError(
                f"{task_name}: idempotency_key must be a template string or a callable, got {key!r}"
            )

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Map positional and keyword arguments to parameter names, defaults applied."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ConfigurationError(f"{self.task_name}: arguments do not match the task: {exc}") from exc
        bound.apply_defaults()
        return {name: _jsonable(value) for name, value in bound.arguments.items()}

    def identity(self, args: Sequence[Any], kwargs: Mapping[str, Any], explicit_key: str | None = None) -> Identity:
        """Return the key (explicit, template, callable, or content-addressed) and fingerprint of a call."""
        arguments = self.bind(args, kwargs)
        chosen = arguments if self.fields is None else {f: arguments[f] for f in self.fields}
        digests = {name: sha256_hex(canonical_json(value)) for name, value in chosen.items()}
        fingerprint = sha256_hex(canonical_json(chosen))
        if explicit_key is not None:
            key = explicit_key
        elif isinstance(self.key_spec, str):
            key = self.key_spec.format(**arguments)
        elif callable(self.key_spec):
            key = self.key_spec(*args, **kwargs)
        else:
            # Content addressed: never a random UUID and never Celery's task id (retry() reuses it).
            key = "sha256:" + sha256_hex(canonical_json(arguments))
        return Identity(key=validate_key(key), fingerprint=fingerprint, field_digests=digests)


def differing_fields(stored: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    """Return the sorted names whose digests differ (or exist on one side only)."""
    return sorted(n for n in set(stored) | set(current) if stored.get(n) != current.get(n))


def _jsonable(value: Any) -> Any:
    # Tuples and lists are the same JSON; normalise so a retried message (lists) fingerprints the same.
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value
