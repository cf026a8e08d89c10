"""Idempotency keys from business data and payload fingerprints (canonical JSON, sha256).

Keys mean one thing (G9): every value substituted into a key template is encoded so that distinct
arguments never give the same key — strings are NFC-normalised and percent-encoded (so a ":" inside a
value cannot pass for the template's own separator), integers (and integral floats: 3 == 3.0) are written
in decimal, and anything else (bool, None, lists, dicts, other floats) as "~" + canonical JSON, encoded.
A tenant namespaces keys: the run's row carries it, so one tenant never replays, conflicts with or blocks
another's key.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import json
import math
import string
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from oncelery.errors import ConfigurationError, InvalidKey, PayloadNotJSON
from oncelery.settings import MAX_KEY_LENGTH

__all__ = [
    "FingerprintSpec",
    "Identity",
    "KeyBuilder",
    "KeySpec",
    "canonical_json",
    "differing_fields",
    "encode_key_value",
    "sha256_hex",
    "validate_key",
]

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


def validate_key(key: Any, what: str = "idempotency key") -> str:
    """Return `key` if it is a non-empty str of at most 255 chars, printable and encodable, else raise."""
    if not isinstance(key, str) or not key:
        raise InvalidKey(f"An {what} must be a non-empty string, got {key!r}", key=repr(key))
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(
            f"The {what} is {len(key)} characters, the limit is {MAX_KEY_LENGTH}: "
            f"derive a shorter one (e.g. hash the long part): {key[:60]!r}...",
            key=key[:MAX_KEY_LENGTH],
        )
    # isprintable() (C, no per-character Python) is False for every Cc and Cs character: most keys stop here.
    bad = [] if key.isprintable() else [ch for ch in key if unicodedata.category(ch) in ("Cc", "Cs")]
    if bad:
        raise InvalidKey(
            f"The {what} {key!r} contains control characters or lone surrogates {bad!r}: use printable text only",
            key=key.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace"),
        )
    return key


# Characters a substituted string keeps as they are; every other one is percent-encoded ("%" included, so
# the encoding is one-to-one, and "~", which marks a JSON-encoded value).
_KEY_SAFE = "-._"


def encode_key_value(value: Any) -> str:
    """Return `value` as it stands in a key: distinct values give distinct text (see the module's doc)."""
    if isinstance(value, str):
        return quote(unicodedata.normalize("NFC", value), safe=_KEY_SAFE)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return "~" + quote(canonical_json(value), safe=_KEY_SAFE)


@dataclass(frozen=True)
class Identity:
    """What the claim engine needs about one call: its key, tenant, payload fingerprint and field digests."""

    key: str
    fingerprint: str
    field_digests: dict[str, str]
    tenant: str = ""


class KeyBuilder:
    """Derives keys and fingerprints for one task's signature; validates its options at decoration time."""

    def __init__(
        self,
        func: Callable[..., Any],
        task_name: str,
        key: KeySpec,
        fields: FingerprintSpec,
        tenant: KeySpec = None,
        what: str = "idempotency_key",
    ):
        self.task_name = task_name
        self.signature = inspect.signature(func)
        self.key_spec = key
        self.tenant_spec = tenant
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
        for option, spec in ((what, key), ("tenant", tenant)):
            if isinstance(spec, str):
                names = _template_fields(task_name, option, spec, params)
                missing = sorted(n for n in names if self.fields is not None and n not in self.fields)
                if missing and option == what:
                    # A key field outside the fingerprint would let two payloads that differ there share a
                    # key without a conflict: refused when the task is created.
                    raise ConfigurationError(
                        f"{task_name}: {option} template {spec!r} uses {missing}, which the fingerprint "
                        f"{list(self.fields or ())} leaves out; add them to fingerprint="
                    )
            elif spec is not None and not callable(spec):
                raise ConfigurationError(f"{task_name}: {option} must be a template string or a callable, got {spec!r}")

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Map positional and keyword arguments to parameter names, defaults applied."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ConfigurationError(f"{self.task_name}: arguments do not match the task: {exc}") from exc
        bound.apply_defaults()
        return {name: _jsonable(value) for name, value in bound.arguments.items()}

    def identity(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        explicit_key: str | None = None,
        explicit_tenant: str | None = None,
        digest_key: bytes | None = None,
    ) -> Identity:
        """Return the key (explicit, template, callable, or content-addressed), tenant and fingerprint of a call.

        Per-field digests (they name the fields of a conflict) are HMAC-SHA256 under `digest_key`, so a
        low-entropy field cannot be brute-forced from the table; without a key no field digests are kept.
        """
        arguments = self.bind(args, kwargs)
        chosen = arguments if self.fields is None else {f: arguments[f] for f in self.fields}
        digests = (
            {name: hmac.digest(digest_key, canonical_json(v).encode(), "sha256").hex() for name, v in chosen.items()}
            if digest_key
            else {}
        )
        fingerprint = sha256_hex(canonical_json(chosen))
        key = self._render(self.key_spec, explicit_key, args, kwargs, arguments)
        if key is None:
            # Content addressed: never a random UUID and never Celery's task id (retry() reuses it).
            key = "sha256:" + sha256_hex(canonical_json(arguments))
        tenant = self._render(self.tenant_spec, explicit_tenant, args, kwargs, arguments) or ""
        if tenant:
            validate_key(tenant, "tenant")
        return Identity(key=validate_key(key), fingerprint=fingerprint, field_digests=digests, tenant=tenant)

    @staticmethod
    def _render(
        spec: KeySpec, explicit: str | None, args: Sequence[Any], kwargs: Mapping[str, Any], arguments: dict[str, Any]
    ) -> str | None:
        if explicit is not None:
            return explicit
        if isinstance(spec, str):
            return spec.format(**{name: encode_key_value(value) for name, value in arguments.items()})
        if callable(spec):
            try:
                return str(spec(*args, **kwargs))
            except Exception as exc:  # a user's callable: its failure becomes a typed error naming it
                raise ConfigurationError(f"The key callable {spec!r} failed on these arguments: {exc!r}") from exc
        return None


def differing_fields(stored: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    """Return the sorted names whose digests differ (or exist on one side only)."""
    return sorted(n for n in set(stored) | set(current) if stored.get(n) != current.get(n))


def _template_fields(task_name: str, option: str, template: str, params: list[str]) -> set[str]:
    """Return the parameter names a template uses; raise unless each field is a bare {param}."""
    names: set[str] = set()
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if name not in params or spec or conversion:
            raise ConfigurationError(
                f"{task_name}: {option} template {template!r}: {{{name}}} is not a bare placeholder of one of the "
                f"parameters of the task {params}; write {{param}} (values are encoded, not formatted)"
            )
        names.add(name)
    return names


def _jsonable(value: Any) -> Any:
    # One JSON form per value, so a retried message fingerprints as the first one did: tuples are lists,
    # strings are NFC (café typed two ways is one value), integral floats are ints (3.0 is version 3).
    if isinstance(value, str):
        return unicodedata.normalize("NFC", value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value
