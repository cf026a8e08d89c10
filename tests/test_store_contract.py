"""The claim protocol's contract, run against every store (SQLite and PostgreSQL), with real races."""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event, insert, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import IntegrityError, InvalidRequestError
from sqlalchemy.orm import Session

from oncelery import LeaseLost, SchemaMissing, StoreError, testing
from oncelery.delivery import renewal
from oncelery.delivery.renewal import Heartbeat
from oncelery.models import Outcome, RunStatus, TaskRun
from oncelery.runs.claims import RunStore
from oncelery.runs.decisions import Claim, Decision, completion_counts
from oncelery.runs.keys import Identity
from oncelery.store.driver import DriverStatement, driver_statement, statement_listeners
from oncelery.store.tables import OUTCOME_TOTALS
from tests.conftest import ON_POSTGRESQL, ON_SQLITE
from tests.services import count_rows, effects_table, wait_for

TASK = "oncelery.contract"


def ident(key: str = "k1", payload: str = "p") -> Identity:
    return Identity(key=key, fingerprint="fp-" + payload, field_digests={"text": "d-" + payload})


def race(n: int, fn: Callable[[], Any]) -> list[Any]:
    """Run `fn` in `n` threads released together by a Barrier; return results (exceptions re-raised)."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def expire_lease(store: RunStore, claim: Claim) -> None:
    """Move a lease into the past by the database clock (as if its holder froze): the kit's helper."""
    testing.expire_lease(store.url, claim.task_name, claim.key, claim.tenant)


def test_fifty_racing_claims_yield_exactly_one_holder(db_url: str) -> None:
    store = RunStore(db_url)
    outcomes = race(50, lambda: store.claim(TASK, ident(), lease=30))
    winners = [o for o in outcomes if o.decision is Decision.CLAIMED]
    assert len(winners) == 1
    assert all(o.decision is Decision.IN_PROGRESS for o in outcomes if o not in winners)
    assert winners[0].claim.token == 1


def test_live_lease_is_not_taken_over_and_expired_one_is_with_a_new_token(db_url: str) -> None:
    store = RunStore(db_url)
    first = store.claim(TASK, ident(), lease=30).claim
    assert first is not None
    assert store.claim(TASK, ident(), lease=30).decision is Decision.IN_PROGRESS
    expire_lease(store, first)
    second = store.claim(TASK, ident(), lease=30)
    assert second.decision is Decision.CLAIMED and second.claim is not None
    assert second.claim.token == 2 and second.claim.takeover and second.claim.owner != first.owner


def test_racing_takeovers_of_an_expired_lease_yield_one_holder(db_url: str) -> None:
    store = RunStore(db_url)
    first = store.claim(TASK, ident(), lease=30).claim
    assert first is not None
    expire_lease(store, first)
    outcomes = race(20, lambda: store.claim(TASK, ident(), lease=30))
    winners = [o.claim for o in outcomes if o.decision is Decision.CLAIMED]
    assert len(winners) == 1 and winners[0].token == 2


def test_zombie_cannot_heartbeat_complete_or_commit_effects(db_url: str) -> None:
    store = RunStore(db_url)
    zombie = store.claim(TASK, ident(), lease=30).claim
    assert zombie is not None
    expire_lease(store, zombie)
    taker = store.claim(TASK, ident(), lease=30).claim
    assert taker is not None
    assert store.heartbeat(zombie) is False
    session = Session(store.engine)
    session.execute(insert(effects_table).values(key="zombie", pid=1))
    with pytest.raises(LeaseLost, match="stale"):
        store.complete(zombie, {"by": "zombie"}, session)
    assert count_rows(store.engine, effects_table, "zombie") == 0
    assert store.fail(zombie, "late failure") is False
    store.complete(taker, {"by": "taker"})
    run = store.get(TASK, "k1")
    assert run is not None and run.status is RunStatus.COMPLETED and run.result == {"by": "taker"} and run.token == 2


def test_heartbeat_extends_the_lease_by_the_database_clock(db_url: str) -> None:
    store = RunStore(db_url)
    claim = store.claim(TASK, ident(), lease=1).claim
    assert claim is not None
    started = time.monotonic()
    while time.monotonic() - started < 1.5:  # renew for longer than one lease period
        assert store.heartbeat(claim)
        assert store.claim(TASK, ident(), lease=1).decision is Decision.IN_PROGRESS
        time.sleep(0.15)
    # Without renewals the lease runs out (database clock) and a new claimant takes over.
    taken = wait_for(lambda: store.claim(TASK, ident(), lease=1).claim, timeout=30, what="lease expiry")
    assert taken.token == 2


def test_failed_run_is_taken_over_and_completed_run_replays(db_url: str) -> None:
    store = RunStore(db_url)
    claim = store.claim(TASK, ident(), lease=30).claim
    assert claim is not None
    assert store.fail(claim, "boom")
    again = store.claim(TASK, ident(), lease=30)
    assert again.decision is Decision.CLAIMED and again.claim is not None and again.claim.attempts == 2
    store.complete(again.claim, [1, 2, 3])
    done = store.claim(TASK, ident(), lease=30)
    assert done.decision is Decision.COMPLETED and done.run is not None and done.run.result == [1, 2, 3]


def test_different_fingerprint_is_a_conflict_in_every_state(db_url: str) -> None:
    store = RunStore(db_url)
    claim = store.claim(TASK, ident(payload="a"), lease=30).claim
    assert claim is not None
    assert store.claim(TASK, ident(payload="b"), lease=30).decision is Decision.CONFLICT
    store.fail(claim, "x")
    assert store.claim(TASK, ident(payload="b"), lease=30).decision is Decision.CONFLICT
    retry = store.claim(TASK, ident(payload="a"), lease=30).claim
    assert retry is not None
    store.complete(retry, "ok")
    res = store.claim(TASK, ident(payload="b"), lease=30)
    assert res.decision is Decision.CONFLICT and res.run is not None and res.run.result == "ok"


def test_one_running_run_per_entity_is_enforced_by_the_partial_unique_index(db_url: str) -> None:
    store = RunStore(db_url)
    keys = [f"job-{i}" for i in range(10)]
    results = race(10, lambda: store.claim(TASK, ident(keys.pop()), lease=30, concurrency_key="article:1"))
    winners = [r.claim for r in results if r.decision is Decision.CLAIMED]
    assert len(winners) == 1
    assert sum(r.decision is Decision.ENTITY_BUSY for r in results) == 9
    store.complete(winners[0], "first")
    # The entity is free once the holder is not RUNNING.
    assert store.claim(TASK, ident("job-next"), lease=30, concurrency_key="article:1").decision is Decision.CLAIMED
    # Even a raw INSERT that bypasses the store cannot make a second RUNNING run for the entity.
    with store.engine.begin() as conn, pytest.raises(IntegrityError, match=r"(?i)unique"):
        conn.execute(
            insert(TaskRun).values(
                task_name=TASK,
                idempotency_key="job-y",
                fingerprint="f",
                field_digests={},
                status=RunStatus.RUNNING,
                fencing_token=1,
                attempts=1,
                concurrency_key="article:1",
            )
        )


def test_status_check_constraint_rejects_unknown_status(db_url: str) -> None:
    store = RunStore(db_url)
    with store.engine.begin() as conn, pytest.raises(IntegrityError, match=r"(?i)check"):
        conn.execute(
            text(
                "INSERT INTO task_runs (task_name, idempotency_key, fingerprint, field_digests, status, "
                "fencing_token, attempts) VALUES ('t', 'k', 'f', '{}', 'WEIRD', 1, 1)"
            )
        )


def test_outcome_counts_are_exact_under_concurrency(db_url: str) -> None:
    from oncelery.models import Outcome

    store = RunStore(db_url)
    race(20, lambda: store.record_outcome(TASK, Outcome.REPLAYED))
    assert store.outcome_counts(TASK) == {"replayed": 20}


def test_a_first_executions_statements_go_straight_to_the_driver(db_url: str) -> None:
    """A claim, a renewal and a completion run no statement through SQLAlchemy's execution: psycopg gets the
    claim and the completion with its count (2 statements), sqlite3 the claim, the completion and the count
    (3), each write in a transaction of its own (BEGIN IMMEDIATE .. COMMIT on SQLite); the run is COMPLETED."""
    store = RunStore(db_url)
    through_sqlalchemy: list[str] = []
    to_driver: list[str] = []

    def on_cursor(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        through_sqlalchemy.append(statement)

    event.listen(Engine, "before_cursor_execute", on_cursor)
    statement_listeners.append(lambda statement, _params: to_driver.append(statement))
    try:
        res = store.claim(TASK, ident("straight"), lease=30)
        assert res.claim is not None
        assert store.heartbeat(res.claim)
        store.complete(res.claim, {"v": 1})
    finally:
        event.remove(Engine, "before_cursor_execute", on_cursor)
        statement_listeners.pop()
    assert through_sqlalchemy == []
    assert len(to_driver) == (3 if store.dialect == "postgresql" else 4), to_driver
    run = store.get(TASK, "straight")
    assert run is not None and run.status == RunStatus.COMPLETED and run.result == {"v": 1}
    assert store.outcome_counts(TASK) == {"executed": 1}


@ON_SQLITE
def test_a_sqlite_completion_whose_count_fails_writes_nothing_and_ends_once_later(db_url: str) -> None:
    """SQLite's completion is two statements in one sqlite3 transaction (the run, then its outcome count). When
    the second fails (here its table is gone), the first is rolled back: a typed SchemaMissing, the run still
    RUNNING under the same holder, nothing counted; once the table is back the same holder completes once."""
    store = RunStore(db_url)
    res = store.claim(TASK, ident("half"), lease=30)
    assert res.claim is not None
    with store.db.engine.begin() as conn:
        conn.execute(text("ALTER TABLE delivery_outcomes RENAME TO delivery_outcomes_away"))
    try:
        with pytest.raises(SchemaMissing, match="oncelery db upgrade"):
            store.complete(res.claim, {"v": 1})
        run = store.get(TASK, "half")
        assert run is not None and run.status == RunStatus.RUNNING and run.result is None
        assert run.token == 1 and run.owner == res.claim.owner and run.lease_live
    finally:
        with store.db.engine.begin() as conn:
            conn.execute(text("ALTER TABLE delivery_outcomes_away RENAME TO delivery_outcomes"))
    assert store.outcome_counts(TASK) == {}
    store.complete(res.claim, {"v": 1})
    run = store.get(TASK, "half")
    assert run is not None and run.status == RunStatus.COMPLETED and run.result == {"v": 1}
    assert store.outcome_counts(TASK) == {"executed": 1}


@ON_SQLITE
def test_a_sqlite_write_transaction_takes_the_write_lock_at_its_first_statement(db_url: str) -> None:
    """A SQLite write transaction begins (BEGIN IMMEDIATE) at its first statement: the work before it, such as
    building its parameters, holds no other writer of the file. Another writer gets the lock until then, not
    after, until the commit; a block that runs no statement writes nothing."""
    store = RunStore(db_url)
    res = store.claim(TASK, ident("lock"), lease=30)
    assert res.claim is not None
    other = sqlite3.connect(make_url(db_url).database or "", timeout=0, isolation_level=None)

    def other_can_write() -> bool:
        try:
            other.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError:  # database is locked: no wait (timeout 0)
            return False
        other.execute("ROLLBACK")
        return True

    try:
        with store.db.begin_statements() as tx:
            assert other_can_write()
            store.complete_txn(tx, res.claim, {"v": 1})
            assert not other_can_write()
        assert other_can_write()
        with store.db.begin_statements():
            pass
    finally:
        other.close()
    run = store.get(TASK, "lock")
    assert run is not None and run.status == RunStatus.COMPLETED and run.result == {"v": 1}
    assert store.outcome_counts(TASK) == {"executed": 1}


def test_a_duplicate_is_claimed_answered_and_counted_in_one_statement(db_url: str) -> None:
    """PostgreSQL: a duplicate of a COMPLETED run sends ONE statement, which counts the replay and its run's
    `replays`; a racing burst of duplicates counts each once. The hot statements stay short enough for
    psycopg to cache their parsing (MAX_CACHED_STATEMENT_LENGTH): past it, each call re-parses the SQL."""
    store = RunStore(db_url)
    ident = Identity("dup", "fp", {})
    first = store.claim("oncelery.contract", ident, lease=30)
    assert first.claim is not None
    store.complete(first.claim, {"v": 1})
    sent: list[str] = []
    engine = store.db.fast_engine if store.dialect == "postgresql" else store.db.engine

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        sent.append(statement)

    def count_driver(statement: str, _params: Any) -> None:
        sent.append(statement)

    # Statements go through SQLAlchemy (SQLite) or straight to psycopg (PostgreSQL): count both ways.
    event.listen(engine, "before_cursor_execute", count)
    statement_listeners.append(count_driver)
    try:
        again = store.claim("oncelery.contract", ident, lease=30)
    finally:
        event.remove(engine, "before_cursor_execute", count)
        statement_listeners.remove(count_driver)
    assert again.decision is Decision.COMPLETED and again.run is not None and again.run.result == {"v": 1}
    if store.dialect == "postgresql":
        assert len(sent) == 1 and again.counted, sent
    else:
        store.record_outcome("oncelery.contract", Outcome.REPLAYED, "", again.run.run_id)
    results = race(20, lambda: store.claim("oncelery.contract", ident, lease=30))
    for res in results:
        assert res.decision is Decision.COMPLETED
        if not res.counted:
            assert res.run is not None
            store.record_outcome("oncelery.contract", Outcome.REPLAYED, "", res.run.run_id)
    run = store.get("oncelery.contract", "dup")
    assert run is not None and run.replays == 21
    assert store.outcome_counts("oncelery.contract") == {"executed": 1, "replayed": 21}
    if store.dialect == "postgresql":
        from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

        for name in ("claim_or_replay", "insert_claim", "complete_and_count", "takeover", "heartbeat"):
            sql = str(getattr(store.sql, name).compile(dialect=store.db.engine.dialect))
            assert len(sql) <= MAX_CACHED_STATEMENT_LENGTH, f"{name}: {len(sql)} characters"


@ON_POSTGRESQL
def test_the_driver_path_sends_what_sqlalchemy_would(db_url: str) -> None:
    """PostgreSQL's one-statement calls bypass SQLAlchemy's execution (oncelery.driver): the parameters they
    send must be exactly SQLAlchemy's, converted the same way (JSON None is JSON null, enums are text), and a
    statement of the wrong shape must still say which parameter is missing."""
    store = RunStore(db_url)
    engine = store.db.fast_engine
    given = {
        "p_task": "t", "p_tenant": "", "p_key": "k", "p_fingerprint": "f", "p_digests": None, "p_owner": "o",
        "p_entity": None, "p_task_id": None, "p_message": {"m": [1]}, "p_abandoned": "", "p_shard": 3,
        "p_lease": 30.0, "p_run_id": 1, "p_token": 1, "p_result": None, "p_outcome": Outcome.EXECUTED,
        "p_error": "e", "p_delay": 1.0,
        **{f"p_{name}": 0 for name in OUTCOME_TOTALS},
    }  # fmt: skip

    def plain(value: Any) -> Any:
        return ("json", value.obj) if type(value).__name__ in ("Json", "Jsonb") else value

    for name in ("claim_or_replay", "complete_and_count", "takeover", "heartbeat", "count_outcome"):
        stmt = getattr(store.sql, name)
        ours = driver_statement(stmt, engine)
        compiled = stmt.compile(dialect=engine.dialect)
        expected = compiled.construct_params(given)
        for key, convert in compiled._bind_processors.items():
            if key in expected:
                expected[key] = convert(expected[key])
        sent = ours.params(given)
        assert {k: plain(v) for k, v in sent.items() if k in expected} == {k: plain(v) for k, v in expected.items()}
        assert ours.sql == compiled.string
        # The slower path, through SQLAlchemy's construct_params (a key rendered under another name): the same.
        walked = DriverStatement(stmt, engine)
        walked.renamed = {"": ""}
        assert {k: plain(v) for k, v in walked.params(given).items()} == {k: plain(v) for k, v in expected.items()}
    with pytest.raises(InvalidRequestError, match="p_token"):
        driver_statement(store.sql.heartbeat, engine).params({"p_run_id": 1, "p_owner": "o", "p_lease": 1.0})


@ON_POSTGRESQL
def test_fenced_writes_find_their_run_by_its_primary_key_however_many_runs_are_in_flight(db_url: str) -> None:
    """PostgreSQL runs the hot statements prepared, with a generic plan. A fence's `status = 'RUNNING'` let that
    plan scan the (status, updated_at) index, reading every RUNNING run on each completion, renewal or failure
    (~1 ms with 3,000 in flight, growing with them): each must find its run by the primary key."""
    store = RunStore(db_url)
    claims = [store.claim("oncelery.plans", Identity(f"k{i}", "f", {}), lease=60).claim for i in range(600)]
    claim = claims[-1]
    assert claim is not None
    given: dict[str, Any] = {
        **store.fence_params(claim),
        **store.lease_params(60),
        **completion_counts(claim, Outcome.EXECUTED, (0, 0)),
        "p_result": None,
        "p_error": "e",
    }
    engine = store.db.engine
    fairy = engine.raw_connection()
    try:
        conn = fairy.driver_connection
        assert conn is not None
        conn.autocommit = True
        conn.execute("SET plan_cache_mode = force_generic_plan")
        for name in ("complete_and_count", "heartbeat", "fail", "kill_lost"):
            stmt = driver_statement(getattr(store.sql, name), engine)
            values = stmt.params(given)
            order: list[str] = []

            def number(match: re.Match[str], order: list[str] = order) -> str:
                if match.group(1) not in order:
                    order.append(match.group(1))
                return f"${order.index(match.group(1)) + 1}"

            conn.execute(f"PREPARE plan_{name} AS " + re.sub(r"%\((\w+)\)s", number, stmt.sql))
            conn.execute("BEGIN")
            try:
                plan = [
                    row[0] for row in conn.execute(f"EXPLAIN (ANALYZE) EXECUTE plan_{name}({_sql_args(order, values)})")
                ]
            finally:
                conn.execute("ROLLBACK")
            scans = [line for line in plan if "Scan" in line and "task_runs" in line]
            removed = sum(int(n) for line in plan for n in re.findall(r"Rows Removed by Filter: (\d+)", line))
            assert scans and all("pk_task_runs" in line for line in scans), (name, plan)
            assert removed <= 1, (name, plan)
    finally:
        fairy.close()


def _sql_args(order: list[str], values: dict[str, Any]) -> str:
    def literal_of(value: Any) -> str:
        if value is None:
            return "NULL"
        if hasattr(value, "obj"):  # psycopg's Json
            value = json.dumps(value.obj)
        if isinstance(value, str):
            return "'" + value.replace("'", "''") + "'"
        return str(value)

    return ", ".join(literal_of(values[name]) for name in order)


def test_a_schema_that_refuses_the_claim_is_a_store_error_not_a_busy_entity(db_url: str) -> None:
    """An integrity error that is not the entity lock (here a CHECK the code does not expect) is a StoreError
    naming `oncelery db upgrade`: taken for a busy entity, the job would bounce "in progress" for ever."""
    store = RunStore(db_url)
    if store.dialect != "postgresql":
        pytest.skip("SQLite cannot add a constraint to an existing table")
    with store.db.begin() as conn:
        conn.execute(text("ALTER TABLE task_runs ADD CONSTRAINT t_never CHECK (attempts > 5) NOT VALID"))
    try:
        with pytest.raises(StoreError, match="oncelery db upgrade"):
            store.claim(TASK, ident("schema"), lease=30, concurrency_key="entity-1")
        assert store.get(TASK, "schema") is None
    finally:
        with store.db.begin() as conn:
            conn.execute(text("ALTER TABLE task_runs DROP CONSTRAINT t_never"))


def test_the_heartbeats_of_finished_runs_do_not_pile_up(db_url: str) -> None:
    """The renewal thread sleeps until the first renewal is due (a lease/3 away) and is not woken per claim:
    the heartbeats of runs that ended meanwhile must not accumulate until then (memory per worker child)."""
    store = RunStore(db_url)
    claim = store.claim("oncelery.heartbeats", Identity("hb", "f", {}), lease=60).claim
    assert claim is not None
    live = [Heartbeat(store, claim).start() for _ in range(10)]
    service = renewal._service()
    before = len(service._heap)
    for _ in range(3000):
        Heartbeat(store, claim).start().stop()
    assert len(service._heap) - before <= 2 * len(live) + 65, len(service._heap)
    for hb in live:
        hb.stop()
