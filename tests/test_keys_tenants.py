"""Keys mean one thing, tenants namespace them, and payloads are not kept in clear."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from celery import Celery

from oncelery import ConfigurationError, IdempotencyConflict, IdempotentTask, InProgress, Runs, RunStatus
from oncelery.runs.claims import RunStore
from oncelery.runs.keys import DIGEST_KEY_ID
from tests.services import ONCELERY, clean_env, wait_for

CLI_TIMEOUT = 60.0


def offline_app(name: str) -> Celery:
    """An app on the in-memory broker, with no claims database (only call-time checks can run)."""
    return Celery(name, broker="memory://")


# -- 1. keys never collide -------------------------------------------------------------------------


def test_separator_inside_a_value_never_collides_with_the_template(
    app: Celery, worker_factory: Any, db_url: str
) -> None:
    """("acme:x", "y") and ("acme", "x:y") get different keys, and each runs with its own result."""
    calls: list[tuple[str, str, str]] = []

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_collide",
        idempotency_key="doc:{tenant}:{doc_id}",
        fingerprint=("tenant", "doc_id", "text"),
    )
    def summarize(self: IdempotentTask, tenant: str, doc_id: str, text: str) -> dict[str, str]:
        calls.append((tenant, doc_id, text))
        return {"tenant": tenant, "doc_id": doc_id, "summary": text.upper()}

    app.finalize()
    first = summarize.identity_of(("acme:x", "y", "first"), digests=False)
    second = summarize.identity_of(("acme", "x:y", "second"), digests=False)
    assert first.key != second.key

    with worker_factory(app):
        one = summarize.delay("acme:x", "y", "first").get(timeout=60)
        two = summarize.delay("acme", "x:y", "second").get(timeout=60)

    assert one == {"tenant": "acme:x", "doc_id": "y", "summary": "FIRST"}
    assert two == {"tenant": "acme", "doc_id": "x:y", "summary": "SECOND"}
    assert sorted(calls) == [("acme", "x:y", "second"), ("acme:x", "y", "first")]
    runs = Runs(db_url)
    run_one, run_two = runs.get(summarize.name, first.key), runs.get(summarize.name, second.key)
    assert run_one is not None and run_one.status is RunStatus.COMPLETED and run_one.result == one
    assert run_two is not None and run_two.status is RunStatus.COMPLETED and run_two.result == two
    assert summarize.outcome_counts() == {"executed": 2}


# -- 2. one value, one key -------------------------------------------------------------------------


def test_equal_values_written_differently_share_key_and_fingerprint(app: Celery, db_url: str) -> None:
    """3 and 3.0, "café" in NFC and NFD, and a dict in another order each give one key and one fingerprint."""
    calls: list[Any] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_version", idempotency_key="v:{version}")
    def versioned(self: IdempotentTask, version: Any, text: str) -> str:
        calls.append(("version", version, text))
        return f"{text}@{version}"

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_meta", idempotency_key="k:{meta}")
    def with_meta(self: IdempotentTask, meta: dict[str, Any]) -> str:
        calls.append(("meta", meta))
        return "ok"

    app.finalize()
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    assert nfc != nfd  # two spellings of one word
    pairs = [
        (versioned, (3, "x"), (3.0, "x")),
        (versioned, (nfc, "x"), (nfd, "x")),
        (versioned, (1, nfc), (1, nfd)),
        (with_meta, ({"a": 1, "b": [1, 2]},), ({"b": [1, 2], "a": 1},)),
    ]
    for task, left, right in pairs:
        a, b = task.identity_of(left), task.identity_of(right)
        assert a.key == b.key, (left, right)
        assert a.fingerprint == b.fingerprint, (left, right)
        assert a.field_digests == b.field_digests, (left, right)

    # Delivered, the second spelling replays the first run (no conflict, no second execution).
    assert versioned(3, "x") == "x@3"
    assert versioned(3.0, "x") == "x@3"
    assert versioned(nfd, "x") == versioned(nfc, "x")
    assert with_meta({"a": 1, "b": [1, 2]}) == with_meta({"b": [1, 2], "a": 1}) == "ok"
    assert [c[0] for c in calls] == ["version", "version", "meta"]
    assert Runs(db_url).outcome_counts(versioned.name) == {"executed": 2, "replayed": 2}
    assert Runs(db_url).outcome_counts(with_meta.name) == {"executed": 1, "replayed": 1}


# -- 3. templates are checked when the task is created ---------------------------------------------


@pytest.mark.parametrize(
    ("template", "fingerprint", "match"),
    [
        ("a:{x}:{y}", ("x",), "leaves out"),
        ("a:{x:03d}", None, "not a bare placeholder"),
        ("a:{x.y}", None, "not a bare placeholder"),
        ("a:{x!r}", None, "not a bare placeholder"),
    ],
    ids=["field-outside-fingerprint", "format-spec", "attribute", "conversion"],
)
def test_bad_key_template_fails_when_the_task_is_created(
    template: str, fingerprint: tuple[str, ...] | None, match: str
) -> None:
    """A template field outside the fingerprint, a format spec, an attribute or a conversion is refused at once."""
    app = offline_app("templates")
    app.finalize()  # a finalized app creates the task at decoration time
    with pytest.raises(ConfigurationError, match=match):

        @app.task(
            shared=False,
            base=IdempotentTask,
            bind=True,
            name="oncelery.t_bad_template",
            idempotency_key=template,
            fingerprint=fingerprint,
        )
        def job(self: IdempotentTask, x: int, y: int) -> int:
            return x + y


# -- 4. tenants ------------------------------------------------------------------------------------


def test_same_key_under_two_tenants_runs_twice(app: Celery, worker_factory: Any, db_url: str) -> None:
    """A per-call tenant namespaces the key: two runs, own results, no cross-tenant conflict, counts per tenant."""
    calls: list[str] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_tenant_call", idempotency_key="doc:{d}")
    def summarize(self: IdempotentTask, d: str, text: str) -> dict[str, Any]:
        calls.append(text)
        return {"summary": text.upper(), "run_id": self.run_id}

    with worker_factory(app):
        acme = summarize.apply_async(("d1", "hello"), tenant="acme").get(timeout=60)
        globex = summarize.apply_async(("d1", "hello"), tenant="globex").get(timeout=60)
        # Another payload under a third tenant is that tenant's first use of the key, not a conflict.
        initech = summarize.apply_async(("d1", "other"), tenant="initech").get(timeout=60)
        # Within one tenant the same payload replays that tenant's result, and another payload conflicts.
        again = summarize.apply_async(("d1", "hello"), tenant="acme").get(timeout=60)
        with pytest.raises(IdempotencyConflict):
            summarize.apply_async(("d1", "other"), tenant="acme").get(timeout=60)

    assert calls == ["hello", "hello", "other"]
    assert acme["summary"] == globex["summary"] == "HELLO" and initech["summary"] == "OTHER"
    assert len({acme["run_id"], globex["run_id"], initech["run_id"]}) == 3
    assert again == acme
    runs = Runs(db_url)
    for tenant, result in (("acme", acme), ("globex", globex), ("initech", initech)):
        run = runs.get(summarize.name, "doc:d1", tenant)
        assert run is not None and run.tenant == tenant, tenant
        assert run.status is RunStatus.COMPLETED and run.result == result and run.run_id == result["run_id"]
    assert runs.get(summarize.name, "doc:d1") is None  # nothing ran without a tenant
    assert runs.outcome_counts(summarize.name, tenant="acme") == {"executed": 1, "replayed": 1, "conflict": 1}
    assert runs.outcome_counts(summarize.name, tenant="globex") == {"executed": 1}
    assert runs.outcome_counts(summarize.name, tenant="initech") == {"executed": 1}
    assert runs.outcome_counts(summarize.name) == {"executed": 3, "replayed": 1, "conflict": 1}


def test_busy_entity_in_one_tenant_does_not_block_another(app: Celery, worker_factory: Any, db_url: str) -> None:
    """With tenant="{org}", a concurrency_key held in acme refuses acme's other key but not globex's."""
    calls: list[tuple[str, str, str]] = []

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_tenant_entity",
        idempotency_key="doc:{doc}",
        tenant="{org}",
        concurrency_key="user:{user}",
        on_in_progress="raise",
    )
    def rescore(self: IdempotentTask, org: str, user: str, doc: str) -> str:
        calls.append((org, user, doc))
        return f"{org}/{user}/{doc}"

    app.finalize()
    held_ident = rescore.identity_of(("acme", "u1", "d1"))
    assert held_ident.tenant == "acme"
    store = RunStore(db_url)
    held = store.claim(rescore.name, held_ident, lease=60, concurrency_key="user:u1")
    assert held.claim is not None  # acme's d1 runs for user u1 (a live lease)

    with worker_factory(app):
        with pytest.raises(InProgress, match="entity"):
            rescore.delay("acme", "u1", "d2").get(timeout=60)
        assert rescore.delay("globex", "u1", "d2").get(timeout=60) == "globex/u1/d2"

    assert calls == [("globex", "u1", "d2")]
    runs = Runs(db_url)
    other = runs.get(rescore.name, "doc:d2", "globex")
    assert other is not None and other.status is RunStatus.COMPLETED and other.concurrency_key == "user:u1"
    assert runs.get(rescore.name, "doc:d2", "acme") is None
    held_run = runs.get(rescore.name, "doc:d1", "acme")
    assert held_run is not None and held_run.status is RunStatus.RUNNING and held_run.lease_live
    assert runs.outcome_counts(rescore.name, tenant="acme") == {"in_progress": 1}
    assert runs.outcome_counts(rescore.name, tenant="globex") == {"executed": 1}


# -- 5. payloads are not kept in clear -------------------------------------------------------------


def _blocking_task(app: Celery, name: str, gate: threading.Event, started: threading.Event, **options: Any) -> Any:
    """Define a task that signals `started`, then blocks until the test sets `gate`."""

    @app.task(shared=False, base=IdempotentTask, bind=True, name=name, idempotency_key="doc:{d}", **options)
    def blocking(self: IdempotentTask, d: str, prompt: str) -> str:
        started.set()
        if not gate.wait(60):
            raise TimeoutError("the test never released the body")
        return "done"

    return blocking


def test_redis_broker_run_keeps_no_message(app: Celery, worker_factory: Any, db_url: str) -> None:
    """On the Redis broker a run's row holds no message, neither while it runs nor after it completes."""
    gate, started = threading.Event(), threading.Event()
    task = _blocking_task(app, "oncelery.t_no_message", gate, started)
    runs = Runs(db_url)
    with worker_factory(app):
        try:
            result = task.delay("d1", "secret prompt")
            assert started.wait(60)
            running = runs.get(task.name, "doc:d1")
            assert running is not None and running.status is RunStatus.RUNNING
            assert running.message is None
        finally:
            gate.set()
        assert result.get(timeout=60) == "done"
    done = runs.get(task.name, "doc:d1")
    assert done is not None and done.status is RunStatus.COMPLETED and done.message is None


def test_stored_message_is_dropped_on_completion(app: Celery, worker_factory: Any, db_url: str) -> None:
    """With store_message=True the row keeps the arguments while the run is RUNNING, and drops them on completion."""
    gate, started = threading.Event(), threading.Event()
    task = _blocking_task(app, "oncelery.t_keep_message", gate, started, store_message=True)
    runs = Runs(db_url)
    with worker_factory(app):
        try:
            result = task.delay("d1", "secret prompt")
            assert started.wait(60)
            running = runs.get(task.name, "doc:d1")
            assert running is not None and running.status is RunStatus.RUNNING
            assert running.message is not None
            assert running.message["args"] == ["d1", "secret prompt"]
        finally:
            gate.set()
        assert result.get(timeout=60) == "done"
    done = wait_for(
        lambda: (r := runs.get(task.name, "doc:d1")) is not None and r.status is RunStatus.COMPLETED and r,
        timeout=30,
        what="the run to be COMPLETED",
    )
    assert done.message is None


def test_field_digests_are_keyed_yet_name_the_conflicting_field(app: Celery, db_url: str) -> None:
    """Per-field digests are not the plain sha256 of the value, yet a reused key's conflict names the field."""
    calls: list[str] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_digests", idempotency_key="doc:{d}")
    def summarize(self: IdempotentTask, d: str, text: str, lang: str) -> str:
        calls.append(text)
        return text.upper()

    app.finalize()
    values = {"d": "d1", "text": "yes", "lang": "en"}  # low-entropy values a plain hash would give away
    assert summarize("d1", "yes", "en") == "YES"
    run = Runs(db_url).get(summarize.name, "doc:d1")
    assert run is not None and set(run.field_digests) == {*values, DIGEST_KEY_ID}  # and which key made them
    for name, value in values.items():
        digest = run.field_digests[name]
        plain = {
            hashlib.sha256(json.dumps(value).encode()).hexdigest(),
            hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest(),
            hashlib.sha256(json.dumps(value, ensure_ascii=False).encode("utf-8")).hexdigest(),
            hashlib.sha256(value.encode()).hexdigest(),
        }
        assert digest not in plain, name
    assert len({run.field_digests[name] for name in values}) == len(values)

    with pytest.raises(IdempotencyConflict) as info:
        summarize("d1", "no", "en")
    assert info.value.fields == ["text"]
    assert "text" in str(info.value) and "doc:d1" in str(info.value)
    assert calls == ["yes"]


def test_cli_show_redacts_the_message_unless_asked(app: Celery, db_url: str, tmp_path: Any) -> None:
    """`oncelery runs show` prints a kept message redacted, and its arguments only with --show-payload."""
    secret = "patient 4711 has condition X"

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_cli_message",
        idempotency_key="note:{n}",
        store_message=True,
    )
    def transcribe(self: IdempotentTask, n: int, note: str) -> str:
        raise RuntimeError("model unavailable")

    app.finalize()
    with pytest.raises(RuntimeError, match="model unavailable"):
        transcribe(7, secret)
    run = Runs(db_url).get(transcribe.name, "note:7")
    assert run is not None and run.status is RunStatus.FAILED and run.message is not None  # kept for a re-send

    def show(*extra: str) -> str:
        argv = [ONCELERY, "--database-url", db_url, "runs", "show", "note:7", "--task", transcribe.name, *extra]
        done = subprocess.run(argv, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=CLI_TIMEOUT)
        assert done.returncode == 0, done.stderr
        return done.stdout

    with ThreadPoolExecutor(2) as pool:  # two processes reading the run, side by side
        redacted, shown = pool.map(lambda extra: show(*extra), [(), ("--show-payload",)])
    assert "FAILED" in redacted and "model unavailable" in redacted
    assert "--show-payload prints it" in redacted
    # No part of the note either ("4711" alone may occur by chance inside a hex digest of the run).
    assert secret not in redacted and "patient" not in redacted and "condition X" not in redacted
    assert secret in shown and '"args": [7, ' in shown
