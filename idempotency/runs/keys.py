"""Idempotency keys from business data, and payload fingerprints: what a call is, for the claim.

A key is explicit, a template over the bound arguments (each value encoded one-to-one: runs/encoding.py), a
callable, or content addressed. A tenant namespaces keys: the run's row carries it, so one tenant never replays,
conflicts with or blocks another's key.

The fingerprint and a content-addressed key (`hmac-sha256:<hex>`) are HMAC-SHA256 under the database's identity
key, which never rotates (the same arguments always find their run); per-field digests are HMAC-SHA256 under the
digest key (ONCELERY_DIGEST_KEY), which may rotate. Runs stored before (an unkeyed `sha256:` key and fingerprint,
the old encoding of "42" and "~") are found through `Identity.stored_before` (runs/legacy.py).
"""

from __future__ import annotations

import inspect
import string
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oncelery.errors import ConfigurationError, InvalidKey, PayloadNotJSON
from oncelery.runs.encoding import (
    canonical_json,
    encode_key_value,
    encode_key_value_before,
    encoded_differently_before,
    jsonable,
    keyed_digest,
    printable,
    refuse_unencodable,
    sha256_hex,
)
from oncelery.settings import CONTENT_KEY_PREFIX, LEGACY_CONTENT_KEY_PREFIX, MAX_KEY_LENGTH

__all__ = [
    "DIGEST_KEY_ID",
    "CallKey",
    "FingerprintSpec",
    "Identity",
    "KeyBuilder",
    "KeySpec",
    "StoredBefore",
    "canonical_json",
    "differing_fields",
    "digest_key_rotated",
    "encode_key_value",
    "keyed_digest",
    "pipeline_link_key",
    "sha256_hex",
    "validate_key",
]

KeySpec = str | Callable[..., str] | None
FingerprintSpec = Sequence[str] | None

# What HMAC-SHA256 under the identity key is computed for: one payload never gives its fingerprint as its key.
PURPOSE_FINGERPRINT = "fingerprint"
PURPOSE_CONTENT_KEY = "content-key"

# The entry of a run's field digests that names the digest key they were made with (its first 16 hex of an HMAC
# of nothing): after a rotation a conflict then says its fields are unknown instead of naming every field.
DIGEST_KEY_ID = "~digest_key"
PURPOSE_DIGEST_KEY_ID = "digest-key-id"


def validate_key(key: Any, what: str = "idempotency key") -> str:
    """Return `key` if it is a non-empty str of at most 255 chars, printable and encodable, else raise."""
    if not isinstance(key, str) or not key:
        raise InvalidKey(f"An {what} must be a non-empty string, got {key!r}", key=repr(key))
    if len(key) > MAX_KEY_LENGTH:
        # A template's values are percent-encoded: a CJK character takes 9 characters of the key, an emoji 12.
        encoded = (
            " (counted as encoded: a template's non-ASCII values take up to 12 characters each)" if "%" in key else ""
        )
        raise InvalidKey(
            f"The {what} is {len(key)} characters{encoded}, the limit is {MAX_KEY_LENGTH}: "
            f"derive a shorter one (e.g. hash the long part): {key[:60]!r}...",
            key=key[:MAX_KEY_LENGTH],
        )
    # isprintable() (C, no per-character Python) is False for every Cc and Cs character: most keys stop here.
    bad = [] if key.isprintable() else [ch for ch in key if unicodedata.category(ch) in ("Cc", "Cs")]
    if bad:
        raise InvalidKey(
            f"The {what} {key!r} contains control characters or lone surrogates {bad!r}: use printable text only",
            key=printable(key),
        )
    return key


def pipeline_link_key(pipeline_key: str, position: int, task_name: str) -> str:
    """Return the key of link `position` of a pipeline, stable across re-enqueues: the key of a link with no key of
    its own, and the key every link had before links kept their task's key (runs/legacy.py looks it up)."""
    return validate_key(f"{pipeline_key}/{position}:{task_name}")


@dataclass(frozen=True)
class StoredBefore:
    """A call's identity in the forms stored before keyed digests and injective keys (a legacy lookup's)."""

    tenant: str
    key: str
    fingerprint: str


@dataclass(frozen=True)
class Identity:
    """What the claim engine needs about one call: its key, tenant, payload fingerprint and field digests.

    `stored_before`: the same call as a run stored before the upgrade holds it (None: not derived).
    """

    key: str
    fingerprint: str
    field_digests: dict[str, str]
    tenant: str = ""
    stored_before: StoredBefore | None = None

    def same_payload(self, fingerprint: str) -> bool:
        """Whether a stored `fingerprint` is this call's payload: keyed, or the unkeyed form stored before."""
        before = self.stored_before
        return fingerprint == self.fingerprint or (before is not None and fingerprint == before.fingerprint)

    def renamed_before(self) -> bool:
        """Whether a run stored before the upgrade has another (tenant, key): then only a lookup finds it."""
        before = self.stored_before
        return before is not None and (before.tenant, before.key) != (self.tenant, self.key)

    def as_stored_before(self) -> Identity:
        """This call as a run stored before the upgrade holds it (its tenant, key and unkeyed fingerprint)."""
        before = self.stored_before
        if before is None:
            return self
        return Identity(before.key, before.fingerprint, self.field_digests, before.tenant)


@dataclass(frozen=True)
class CallKey:
    """A call's key and tenant, checked with no secret and no database (a producer's view).

    `key` is None for a content-addressed key: keyed with the database's identity key, it is derived in the worker.
    `key_before` and `tenant_before`: the text the encoding before injective keys gave them, where it differs.
    """

    key: str | None
    tenant: str
    key_before: str | None = None
    tenant_before: str | None = None

    def renamed_before(self) -> bool:
        """Whether a run stored before the upgrade may have another (tenant, key)."""
        return self.key_before is not None or self.tenant_before is not None


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
        # The parameters each template uses: only they are encoded (a long text outside the key is not).
        self.used: dict[str, tuple[str, ...]] = {}
        for option, spec in ((what, key), ("tenant", tenant)):
            if isinstance(spec, str):
                names = _template_fields(task_name, option, spec, params)
                self.used[spec] = tuple(sorted(names))
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
        return {name: jsonable(value) for name, value in bound.arguments.items()}

    def call_key(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        explicit_key: str | None = None,
        explicit_tenant: str | None = None,
    ) -> CallKey:
        """Return the call's key and tenant, refusing what every worker would (bad key or tenant, non-JSON or
        unencodable payload); needs no secret: a content-addressed key (None here) is derived in the worker."""
        arguments = self.bind(args, kwargs)
        call = self._call_key(args, kwargs, arguments, explicit_key, explicit_tenant)
        refuse_unencodable(self._payload(self._chosen(arguments)))
        self.refuse_unstorable(arguments)
        return call

    def refuse_unstorable(self, arguments: dict[str, Any]) -> None:
        """Raise PayloadNotJSON naming the first bound argument that is not JSON, fingerprinted or not.

        Every argument is stored, not only the fingerprinted ones: a kept message, kept arguments, a dead letter
        all hold the call's message. Without a fingerprint= the fingerprint's own encoding already checked them.
        """
        if self.fields is not None:
            refuse_unencodable(self._payload(arguments))

    def named(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[str, str | None]:
        """Return the key a template or callable names (an entity's), and the text it had before, if other."""
        arguments = self.bind(args, kwargs)
        call = self._call_key(args, kwargs, arguments, None, None)
        if call.key is None:
            raise ConfigurationError(f"{self.task_name}: no template or callable names this key; give one")
        return call.key, call.key_before

    def identity(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        explicit_key: str | None = None,
        explicit_tenant: str | None = None,
        digest_key: bytes | None = None,
        identity_key: bytes | None = None,
    ) -> Identity:
        """Return the key (explicit, template, callable, or content-addressed), tenant and fingerprint of a call.

        The fingerprint and a content-addressed key are HMAC-SHA256 under `identity_key` (required: the claims
        database's, which never rotates); per-field digests (they name the fields of a conflict) are HMAC-SHA256
        under `digest_key`, and without it none are kept. `stored_before` holds the forms of runs stored before.
        """
        if not identity_key:
            raise ConfigurationError(
                f"{self.task_name}: a fingerprint is keyed with the claims database's identity key; call the "
                f"task's identity_of() (it reads the key), or key_of() for the key and tenant alone"
            )
        arguments = self.bind(args, kwargs)
        call = self._call_key(args, kwargs, arguments, explicit_key, explicit_tenant)
        chosen = self._chosen(arguments)
        payload = self._payload(chosen)
        fingerprint = keyed_digest(identity_key, payload, PURPOSE_FINGERPRINT)
        digests = {n: keyed_digest(digest_key, canonical_json(v)) for n, v in chosen.items()} if digest_key else {}
        if digest_key:
            digests[DIGEST_KEY_ID] = keyed_digest(digest_key, "", PURPOSE_DIGEST_KEY_ID)[:16]  # which key made them
        key, key_before = call.key, call.key_before
        if key is not None:
            self.refuse_unstorable(arguments)  # a content-addressed key encodes them all below
        if key is None:
            # Content addressed: never a random UUID and never Celery's task id (retry() reuses it).
            everything = payload if chosen is arguments else self._payload(arguments)
            key = CONTENT_KEY_PREFIX + keyed_digest(identity_key, everything, PURPOSE_CONTENT_KEY)
            key_before = LEGACY_CONTENT_KEY_PREFIX + sha256_hex(everything)
        before = StoredBefore(call.tenant_before or call.tenant, key_before or key, sha256_hex(payload))
        return Identity(validate_key(key), fingerprint, digests, call.tenant, before)

    def _payload(self, arguments: dict[str, Any]) -> str:
        """The canonical JSON of `arguments`, or PayloadNotJSON naming the first argument that is not JSON."""
        try:
            return canonical_json(arguments)
        except PayloadNotJSON as exc:
            for name, value in arguments.items():
                try:
                    canonical_json(value)
                except PayloadNotJSON:
                    raise PayloadNotJSON(
                        f"{self.task_name}: argument {name!r} is a {type(value).__name__}, not JSON; pass JSON types "
                        f"(str, int, float, bool, None, list, dict): convert it (str(uuid), .isoformat(), "
                        f".model_dump()), or pass a reference (an id, a URL) to a large object"
                    ) from exc
            raise

    def _chosen(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return arguments if self.fields is None else {f: arguments[f] for f in self.fields}

    def _call_key(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        arguments: dict[str, Any],
        explicit_key: str | None,
        explicit_tenant: str | None,
    ) -> CallKey:
        key = self._render(self.key_spec, explicit_key, args, kwargs, arguments)
        tenant = self._render(self.tenant_spec, explicit_tenant, args, kwargs, arguments) or ""
        if tenant:
            validate_key(tenant, "tenant")
        if key is not None:
            validate_key(key)
        key_before = self._before(self.key_spec, explicit_key, key, arguments)
        tenant_before = self._before(self.tenant_spec, explicit_tenant, tenant, arguments)
        return CallKey(key, tenant, key_before, tenant_before)

    def _render(
        self,
        spec: KeySpec,
        explicit: str | None,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        arguments: dict[str, Any],
    ) -> str | None:
        if explicit is not None:
            return explicit
        if isinstance(spec, str):
            return spec.format(**{name: encode_key_value(arguments[name]) for name in self.used[spec]})
        if callable(spec):
            try:
                return str(spec(*args, **kwargs))
            except Exception as exc:  # a user's callable: its failure becomes a typed error naming it
                raise ConfigurationError(f"The key callable {spec!r} failed on these arguments: {exc!r}") from exc
        return None

    def _before(self, spec: KeySpec, explicit: str | None, text: str | None, arguments: dict[str, Any]) -> str | None:
        """The text a template gave these arguments before injective keys, if other than `text` (else None).

        An explicit key or tenant counts as the template's when it is the template's text (the outbox stores it).
        """
        if not isinstance(spec, str) or not text:
            return None
        used = self.used[spec]
        if not any(encoded_differently_before(arguments[name]) for name in used):
            return None
        if explicit is not None and explicit != spec.format(**{n: encode_key_value(arguments[n]) for n in used}):
            return None
        before = spec.format(**{name: encode_key_value_before(arguments[name]) for name in used})
        return before if before != text and len(before) <= MAX_KEY_LENGTH else None


def differing_fields(stored: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    """Return the sorted names whose digests differ (or exist on one side only); none when the digest key
    rotated since `stored` was made (then every digest differs and tells nothing: see `digest_key_rotated`)."""
    if digest_key_rotated(stored, current):
        return []
    names = (set(stored) | set(current)) - {DIGEST_KEY_ID}
    return sorted(n for n in names if stored.get(n) != current.get(n))


def digest_key_rotated(stored: Mapping[str, str], current: Mapping[str, str]) -> bool:
    """Whether `stored` and `current` field digests were made under different digest keys (a rotation)."""
    return DIGEST_KEY_ID in stored and DIGEST_KEY_ID in current and stored[DIGEST_KEY_ID] != current[DIGEST_KEY_ID]


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
