"""Keys, fingerprints, call-time validation and picklable errors (no services needed)."""

from __future__ import annotations

import pickle

import pytest
from celery import Celery

from oncelery import (
    ConfigurationError,
    IdempotencyConflict,
    IdempotentTask,
    InvalidKey,
    LeaseLost,
    OnceleryError,
    PayloadNotJSON,
    SchemaMissing,
)
from oncelery.runs.keys import KeyBuilder, canonical_json, differing_fields


def score(article_id: str, version: int, text: str, lang: str = "en") -> None:
    """A stand-in task signature."""


# The claims database's identity key, as a builder receives it (IdempotentTask.identity_of reads it).
IDENTITY_KEY = b"k" * 64


def test_template_key_uses_bound_arguments_and_defaults() -> None:
    kb = KeyBuilder(score, "oncelery.score", "article:{article_id}:v{version}:{lang}", None)
    ident = kb.identity(("a1",), {"version": 3, "text": "hi"}, identity_key=IDENTITY_KEY)
    assert ident.key == "article:a1:v3:en"


def test_fingerprint_is_canonical_and_limited_to_chosen_fields() -> None:
    kb = KeyBuilder(score, "oncelery.score", "a:{article_id}", ("article_id", "text"))
    a = kb.identity(("a1", 1, "hello"), {}, digest_key=b"secret", identity_key=IDENTITY_KEY)
    b = kb.identity(
        (), {"text": "hello", "version": 99, "article_id": "a1"}, digest_key=b"secret", identity_key=IDENTITY_KEY
    )
    assert a.fingerprint == b.fingerprint  # version is not fingerprinted, kwarg order is irrelevant
    c = kb.identity(("a1", 1, "other"), {}, digest_key=b"secret", identity_key=IDENTITY_KEY)
    assert differing_fields(a.field_digests, c.field_digests) == ["text"]


def test_default_key_is_content_addressed_not_random() -> None:
    kb = KeyBuilder(score, "oncelery.score", None, None)
    k1 = kb.identity(("a1", 1, "x"), {}, identity_key=IDENTITY_KEY).key
    assert k1 == kb.identity(("a1", 1, "x"), {}, identity_key=IDENTITY_KEY).key
    assert k1 != kb.identity(("a1", 2, "x"), {}, identity_key=IDENTITY_KEY).key
    assert k1.startswith("hmac-sha256:")  # keyed (runs stored before hold "sha256:"; a legacy lookup finds them)
    assert kb.call_key(("a1", 1, "x"), {}).key is None  # a producer, with no database, leaves it to the worker


def test_callable_key() -> None:
    kb = KeyBuilder(score, "oncelery.score", lambda article_id, version, text: f"{article_id}/{version}", None)
    assert kb.identity(("a9", 4, "t"), {}, identity_key=IDENTITY_KEY).key == "a9/4"


def test_bad_options_fail_at_decoration_time() -> None:
    with pytest.raises(ConfigurationError, match="is not a bare placeholder"):
        KeyBuilder(score, "oncelery.score", "article:{missing}", None)
    with pytest.raises(ConfigurationError, match="fingerprint names"):
        KeyBuilder(score, "oncelery.score", None, ("nope",))
    app = Celery("decoration")
    with pytest.raises(ConfigurationError, match="on_in_progress"):

        @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.bad_policy", on_in_progress="wait")
        def bad(self: IdempotentTask, x: int) -> int:
            return x

        app.finalize()
        _ = bad.name


@pytest.mark.parametrize("key", ["", "x" * 256, "bad\nkey", "tab\there", "nul\x00"])
def test_invalid_keys_are_rejected_at_call_time(key: str) -> None:
    app = Celery("calltime", broker="memory://")

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.calltime", idempotency_key="doc:{doc}")
    def job(self: IdempotentTask, doc: str) -> str:
        return doc

    with pytest.raises(InvalidKey):
        job.apply_async(("d",), idempotency_key=key)
    if len(key) > 255:  # a template that renders too long a key fails in the caller too, before anything is sent
        with pytest.raises(InvalidKey):
            job.delay(key)
    elif key:  # a control character in a value is percent-encoded into the key, never refused or smuggled
        assert job.key_of((key,)).key == "doc:" + "".join(ch if ch.isalnum() else f"%{ord(ch):02X}" for ch in key)


def test_non_json_payload_is_a_typed_error() -> None:
    with pytest.raises(PayloadNotJSON, match="JSON types"):
        canonical_json({"x": {1, 2}})


@pytest.mark.parametrize(
    "exc",
    [
        IdempotencyConflict("k differs", task_name="t", key="k", fields=["text"]),
        LeaseLost("lost", task_name="t", key="k", token=3),
        SchemaMissing("run oncelery db upgrade", url="sqlite://"),
        OnceleryError("plain"),
    ],
)
def test_errors_survive_pickling_with_their_fields(exc: OnceleryError) -> None:
    clone = pickle.loads(pickle.dumps(exc))
    assert type(clone) is type(exc)
    assert str(clone) == str(exc)
    assert clone.context == exc.context
    for name, value in exc.context.items():
        assert getattr(clone, name) == value
