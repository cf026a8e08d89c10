"""What a run stores reveals no argument without the key, and duplicates still replay across the upgrade and a rotation.

The fingerprint and a content-addressed key are HMAC-SHA256 under the claims database's identity key (never
rotated); per-field digests under the digest key (rotatable). A brute force over the 10,000 four-digit PINs,
which recovered a PIN from the plain sha256 of before in milliseconds, recovers nothing without the key; with
the key (someone who reads oncelery_secrets too: the documented threat model) it does. Runs stored in the old,
unkeyed forms are replayed, not run again. SQLite and PostgreSQL: the legacy lookups are SQL.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select

from oncelery import IdempotencyConflict, IdempotentTask, Relay, Runs, RunStatus, outbox
from oncelery.models import OutboxStatus
from oncelery.settings import IDENTITY_KEY_SECRET
from oncelery.store.database import get_engine
from oncelery.store.tables import OUTBOX, SECRETS
from tests.stored_before import BeforeUpgrade, before_upgrade, old_content_key, old_digest  # noqa: F401

PINS = [f"{n:04d}" for n in range(10_000)]
SECRET_PIN = "4721"


def pin_task(app: Celery, calls: list[str]) -> Any:
    """A task whose only argument is a PIN, with a content-addressed key (no idempotency_key)."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_pin")
    def check_pin(self: IdempotentTask, pin: str) -> str:
        calls.append(pin)
        return "checked"

    app.finalize()
    return check_pin


def canonical(value: Any) -> bytes:
    """Canonical JSON, as Oncelery digests it (what an attacker would reproduce)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def brute_force(stored: set[str], digest: Any) -> set[str]:
    """The PINs whose digest under `digest` (a guess of the formula) appears among the stored values."""
    found = set()
    for pin in PINS:
        guesses = {digest(canonical({"pin": pin})), digest(canonical(pin))}
        guesses |= {"sha256:" + g for g in guesses} | {"hmac-sha256:" + g for g in guesses}
        if guesses & stored:
            found.add(pin)
    return found


def test_a_brute_force_over_every_pin_recovers_nothing_without_the_key(app: Celery, db_url: str) -> None:
    """The stored key, fingerprint and field digests of a PIN: no PIN matches them under the unkeyed formula, nor
    under a guessed key; the identity key from oncelery_secrets recovers it (why that table must be guarded)."""
    calls: list[str] = []
    check_pin = pin_task(app, calls)
    assert check_pin(SECRET_PIN) == "checked"
    (run,) = Runs(db_url).list(task_name=check_pin.name)
    stored = {run.key, run.fingerprint, *run.field_digests.values()}

    def plain(text: bytes) -> str:
        return hashlib.sha256(text).hexdigest()

    def guessed_key(text: bytes) -> str:
        return hmac.digest(b"", text, "sha256").hex()

    assert brute_force(stored, plain) == set()
    assert brute_force(stored, guessed_key) == set()
    with get_engine(db_url).connect() as conn:
        identity_key = conn.execute(select(SECRETS.c.value).where(SECRETS.c.name == IDENTITY_KEY_SECRET)).scalar_one()

    def with_the_key(text: bytes) -> str:
        return hmac.digest(identity_key.encode(), b"fingerprint\0" + text, "sha256").hex()

    assert brute_force(stored, with_the_key) == {SECRET_PIN}  # the same search, given the secret
    assert calls == [SECRET_PIN]


def test_a_content_addressed_run_stored_unkeyed_is_replayed_after_the_upgrade(
    app: Celery,
    db_url: str,
    before_upgrade: BeforeUpgrade,  # noqa: F811
) -> None:
    """A run stored as "sha256:" + sha256(arguments) with its unkeyed fingerprint: the same call replays its result;
    another PIN is claimed under the keyed form."""
    calls: list[str] = []
    check_pin = pin_task(app, calls)
    arguments = {"pin": SECRET_PIN}
    before_upgrade.run(check_pin.name, old_content_key(arguments), old_digest(arguments), result="checked before")

    assert check_pin(SECRET_PIN) == "checked before"
    assert check_pin("0000") == "checked"
    assert calls == ["0000"]
    runs = Runs(db_url).list(task_name=check_pin.name)
    assert sorted(run.key.split(":")[0] for run in runs) == ["hmac-sha256", "sha256"]
    assert Runs(db_url).outcome_counts(check_pin.name) == {"replayed": 1, "executed": 1}


def test_runs_fingerprinted_unkeyed_are_replayed_or_taken_over_after_the_upgrade(
    app: Celery,
    db_url: str,
    before_upgrade: BeforeUpgrade,  # noqa: F811
) -> None:
    """Template keys did not change: a COMPLETED run with the unkeyed fingerprint is replayed (not a conflict), a
    FAILED one is taken over and completed on its own row; another payload under the key is still a conflict."""
    calls: list[str] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_old_fp", idempotency_key="doc:{doc}")
    def job(self: IdempotentTask, doc: str, text: str) -> str:
        calls.append(doc)
        return f"new {doc}"

    app.finalize()
    before_upgrade.run(job.name, "doc:a", old_digest({"doc": "a", "text": "t"}), result="old a")
    failed = before_upgrade.run(job.name, "doc:b", old_digest({"doc": "b", "text": "t"}), status=RunStatus.FAILED)

    assert job("a", "t") == "old a"
    assert job("b", "t") == "new b"
    assert calls == ["b"]
    run = Runs(db_url).get(job.name, "doc:b")
    assert run is not None and run.run_id == failed and run.status is RunStatus.COMPLETED and run.token == 2
    assert Runs(db_url).outcome_counts(job.name) == {"replayed": 1, "executed": 1}


def test_a_rotated_digest_key_changes_no_key_and_no_fingerprint(app: Celery, db_url: str) -> None:
    """Rotating ONCELERY_DIGEST_KEY (app.conf.oncelery_digest_key) re-keys the field digests only: a duplicate after
    the rotation replays the run of a content-addressed call, and of a template call."""
    calls: list[str] = []
    check_pin = pin_task(app, calls)
    app.conf.oncelery_digest_key = "first-digest-key"
    first = check_pin.identity_of((SECRET_PIN,))
    assert check_pin(SECRET_PIN) == "checked"

    app.conf.oncelery_digest_key = "rotated-digest-key"
    rotated = check_pin.identity_of((SECRET_PIN,))
    assert (rotated.key, rotated.fingerprint) == (first.key, first.fingerprint)
    assert rotated.field_digests != first.field_digests
    assert check_pin(SECRET_PIN) == "checked"
    assert calls == [SECRET_PIN]
    assert Runs(db_url).outcome_counts(check_pin.name) == {"executed": 1, "replayed": 1}


def test_a_producer_with_no_database_checks_a_content_addressed_call(published: list[str]) -> None:
    """`.delay()` needs no claims database: the keyed key is derived in the worker, the call is still checked."""
    app = Celery("keyed-producer", broker="memory://")
    calls: list[str] = []
    check_pin = pin_task(app, calls)
    check_pin.delay(SECRET_PIN)
    assert published == [check_pin.name]
    app.close()


def test_a_worker_replays_runs_stored_before_the_upgrade(
    app: Celery,
    worker_factory: Any,
    db_url: str,
    before_upgrade: BeforeUpgrade,  # noqa: F811
) -> None:
    """Through Redis and a real worker: `.delay()` of a content-addressed call stored unkeyed, and an outbox job whose
    run is stored under the old text of "42", are both answered from the stored result; the relay closes the row."""
    calls: list[str] = []
    check_pin = pin_task(app, calls)

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_old_doc", idempotency_key="doc:{doc}")
    def doc_job(self: IdempotentTask, doc: str) -> str:
        calls.append(doc)
        return f"new {doc}"

    before_upgrade.run(check_pin.name, old_content_key({"pin": "1234"}), old_digest({"pin": "1234"}), result="old pin")
    before_upgrade.run(doc_job.name, "doc:42", old_digest({"doc": "42"}), result="old 42")
    with get_engine(db_url).begin() as conn:
        task_id = outbox.enqueue(conn, doc_job, "42")
    relay = Relay(app, db_url, republish_after=0.0, sweep_interval=None)
    with worker_factory(app):
        assert check_pin.delay("1234").get(timeout=60) == "old pin"
        relay.run_once()
        assert doc_job.AsyncResult(task_id).get(timeout=60) == "old 42"
        relay.run_once()
    assert calls == []
    with get_engine(db_url).connect() as conn:
        assert conn.execute(select(OUTBOX.c.status)).scalar_one() is OutboxStatus.DONE
    assert Runs(db_url).outcome_counts() == {"replayed": 2}


def test_after_a_digest_key_rotation_a_conflict_says_its_fields_are_unknown(app: Celery, db_url: str) -> None:
    """A conflict against a run stored under the previous digest key names no field (every digest differs, so
    naming them all would be wrong): it says the fields are unknown because the key changed. Under the same key
    the differing field is named."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_rotated_conflict", idempotency_key="d:{d}")
    def summarize(self: IdempotentTask, d: str, text: str, lang: str) -> str:
        return text

    app.finalize()
    app.conf.oncelery_digest_key = "first-digest-key"
    assert summarize("d1", "yes", "en") == "yes"
    with pytest.raises(IdempotencyConflict) as same_key:
        summarize("d1", "no", "en")
    assert same_key.value.fields == ["text"]
    app.conf.oncelery_digest_key = "rotated-digest-key"
    with pytest.raises(IdempotencyConflict) as rotated:
        summarize("d1", "no", "en")
    assert rotated.value.fields == []
    assert "unknown: the digest key (ONCELERY_DIGEST_KEY) changed" in str(rotated.value)
