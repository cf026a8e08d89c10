"""A prepared intent is committed durably even where the server commits asynchronously: a crash of PostgreSQL
(not a restart) right after it loses an asynchronous commit made later, and keeps the intent.

Without the synchronous commit, an intent whose call was already sent could be forgotten by the crash, and the
next holder would pay for the call again with no label.
"""

from __future__ import annotations

from sqlalchemy import create_engine, select, text
from sqlalchemy.pool import NullPool

from oncelery.ledger.recording import CallLedger
from oncelery.llm.intents import prepare_intent
from oncelery.models import IntentState
from oncelery.runs.claims import RunStore
from oncelery.runs.keys import Identity
from oncelery.store.database import dispose_engines
from oncelery.store.tables import INTENTS, SECRETS
from tests.store_faults import Db

TASK = "oncelery.intent_durability"
ROW = {
    "provider": "fake",
    "endpoint": "responses",
    "model": "m",
    "mode": "background",
    "request_digest": "0" * 64,
    "retention_s": 600.0,
}


def test_a_prepared_intent_survives_a_crash_that_loses_an_asynchronous_commit(pg_db: Db) -> None:
    cluster = pg_db.cluster
    assert cluster is not None
    # The server commits asynchronously and its WAL writer waits 10 s: a crash loses what it has not written.
    cluster.execute("ALTER SYSTEM SET synchronous_commit = off")
    cluster.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
    cluster.execute("SELECT pg_reload_conf()")
    try:
        store = RunStore(pg_db.url)
        claim = store.claim(TASK, Identity(key="k", fingerprint="fp", field_digests={}), lease=30).claim
        assert claim is not None
        ledger = CallLedger(store.db.dialect, {})
        intent = prepare_intent(
            store, claim, position=0, step_name="summary", request=ROW, supersedes=None, reason=None, ledger=ledger
        )
        # Committed after the intent, the server's way (asynchronously): the crash must lose it, or this test
        # could not tell a durable intent from a lucky one.
        with store.db.begin() as conn:
            conn.execute(SECRETS.insert().values(name="control", value="async"))
        cluster.stop("immediate")  # SIGQUIT: a crash, shared memory and unwritten WAL gone
        dispose_engines()
        cluster.start()
        observer = create_engine(pg_db.url, poolclass=NullPool)
        try:
            with observer.connect() as conn:
                kept = conn.execute(select(INTENTS.c.state).where(INTENTS.c.public_id == intent.public_id)).all()
                control = conn.execute(text("SELECT count(*) FROM oncelery_secrets WHERE name = 'control'")).scalar()
        finally:
            observer.dispose()
        assert control == 0, "the crash did not lose the asynchronous commit: the test proves nothing"
        assert kept == [(IntentState.PREPARED,)], "the prepared intent was lost in the crash"
    finally:
        cluster.ensure_running()
        cluster.execute("ALTER SYSTEM RESET synchronous_commit")
        cluster.execute("ALTER SYSTEM RESET wal_writer_delay")
        cluster.execute("SELECT pg_reload_conf()")
