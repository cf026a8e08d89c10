"""Stale events (entity_version=): versions of one entity applied only forward, through a real worker.

Redis broker, an in-process worker with 4 threads, over SQLite and PostgreSQL. The task writes one row per
applied version into an application table, numbered by a per-entity counter that its effects transaction
increments: the counter row's lock is held until the commit, so the numbers of committed rows are their
commit order (rolled-back increments leave no gap).
"""

from __future__ import annotations

import random
import threading
import uuid
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, select, update
from sqlalchemy.engine import Engine

from oncelery import ConfigurationError, IdempotentTask, Runs, RunStatus
from oncelery.runs.claims import RunStore
from tests.services import redis_cli

WORKERS = 4  # worker threads; also the size of each wave of deliveries below
RESULT_TIMEOUT = 60.0
SEEDS = (3, 11, 29, 2024)
KEY = "ev:{entity}:{version}"

app_metadata = MetaData()
applied_table = Table(
    "stale_test_applied",
    app_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("entity", String(255), nullable=False),
    Column("version", Integer, nullable=False),
    Column("seq", Integer, nullable=False),
)
counter_table = Table(
    "stale_test_counters",
    app_metadata,
    Column("entity", String(255), primary_key=True),
    Column("seq", Integer, nullable=False),
)


@pytest.fixture
def app_tables(db_engine: Engine) -> Engine:
    """The application's tables in the claims database (entities are unique per test, so no cleanup)."""
    app_metadata.create_all(db_engine)
    return db_engine


def new_entity(engine: Engine) -> str:
    """A fresh entity id with its commit counter at 0."""
    entity = f"ent-{uuid.uuid4().hex[:10]}"
    with engine.begin() as conn:
        conn.execute(insert(counter_table).values(entity=entity, seq=0))
    return entity


def applied_rows(engine: Engine, entity: str) -> list[tuple[int, int]]:
    """(commit number, version) of each applied row of `entity`, in commit order."""
    t = applied_table.c
    with engine.connect() as conn:
        rows = conn.execute(select(t.seq, t.version).where(t.entity == entity).order_by(t.seq)).all()
    return [(int(seq), int(version)) for seq, version in rows]


def write_applied(task: IdempotentTask, entity: str, version: int, numbered: bool = True) -> None:
    """Inside the body: write the version's row (one savepoint), numbered with `entity`'s next commit number.

    `numbered=False` writes 0 instead and takes no lock on the counter row.
    """
    with task.effects() as session:
        seq = 0
        if numbered:
            c = counter_table.c
            seq = session.execute(
                update(counter_table).where(c.entity == entity).values(seq=c.seq + 1).returning(c.seq)
            ).scalar_one()
        session.execute(insert(applied_table).values(entity=entity, version=version, seq=seq))


def plan(seed: int) -> list[list[int]]:
    """Versions 1..5, each 1-3 times, shuffled by `seed`, cut into waves of WORKERS deliveries."""
    rng = random.Random(seed)
    order = [v for v in range(1, 6) for _ in range(rng.randint(1, 3))]
    rng.shuffle(order)
    return [order[i : i + WORKERS] for i in range(0, len(order), WORKERS)]


def certain_stale(waves: list[list[int]]) -> int:
    """Deliveries that must be stale: a version not above the highest one of an earlier (settled) wave.

    After a wave settles, the entity's applied version is that highest version (nothing higher was sent), so
    such a delivery is refused by the version check whatever the interleaving. Within a wave the order is
    the workers' race: a regression there may be stale before claiming, stale at completion, or applied
    first and then superseded.
    """
    count, highest = 0, 0
    for wave in waves:
        count += sum(1 for v in wave if v <= highest)
        highest = max(highest, *wave)
    return count


# -- 1. shuffled versions with duplicates ------------------------------------------------------------------


def test_shuffled_duplicated_versions_apply_only_forward(
    app: Celery, worker_factory: Any, db_url: str, app_tables: Engine
) -> None:
    started: list[tuple[str, int]] = []
    lock = threading.Lock()

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_stale_shuffled",
        idempotency_key="ev:{entity}:{version}",
        entity="e:{entity}",
        entity_version="version",
    )
    def apply_event(self: IdempotentTask, entity: str, version: int) -> int:
        with lock:
            started.append((entity, version))
        write_applied(self, entity, version)
        return version

    store, runs = RunStore(db_url), Runs(db_url)
    total_sent = total_rows = total_certain = 0
    with worker_factory(app, concurrency=WORKERS):
        for seed in SEEDS:
            waves = plan(seed)
            sent = [v for wave in waves for v in wave]
            certain = certain_stale(waves)
            assert certain > 0, f"seed {seed}: the plan {waves} has no regression across waves"
            entity = new_entity(app_tables)
            for wave in waves:
                # One wave at a time: its deliveries race on the worker's threads; the next wave is sent once
                # every delivery of this one has answered (re-sent in_progress copies included).
                results = [(v, apply_event.delay(entity, v)) for v in wave]
                for v, result in results:
                    assert result.get(timeout=RESULT_TIMEOUT) in (v, None), (seed, v)

            rows = applied_rows(app_tables, entity)
            versions = [v for _, v in rows]
            assert [seq for seq, _ in rows] == list(range(1, len(rows) + 1)), (seed, rows)
            assert versions == sorted(set(versions)), (seed, rows)  # strictly increasing in commit order
            assert versions[-1] == 5, (seed, rows)
            assert store.applied_version(apply_event.name, "", f"e:{entity}") == 5

            # Every distinct version sent has at most one run, COMPLETED: with its version if applied, with no
            # result if a newer version was applied while it ran; one that was always stale has none.
            bodies = sum(1 for e, _ in started if e == entity)
            ran_but_stale = 0
            for version in sorted(set(sent)):
                run = runs.get(apply_event.name, f"ev:{entity}:{version}")
                if run is None:
                    assert version not in versions, (seed, version)
                    continue
                assert run.status is RunStatus.COMPLETED, (seed, version, run)
                if version in versions:
                    assert run.result == version, (seed, version, run)
                else:
                    assert run.result is None, (seed, version, run)
                    ran_but_stale += 1
            assert bodies == len(versions) + ran_but_stale, (seed, bodies, rows)
            total_sent += len(sent)
            total_rows += len(rows)
            total_certain += certain

    counts = apply_event.outcome_counts()
    # One outcome per message sent (in_progress only for copies that were re-sent and then answered).
    assert set(counts) <= {"executed", "stale", "replayed", "in_progress"}, counts
    assert counts.get("executed", 0) + counts.get("stale", 0) + counts.get("replayed", 0) == total_sent, counts
    assert counts.get("executed") == total_rows, counts
    assert counts.get("stale", 0) >= total_certain > 0, counts


# -- 2. an old attempt finishing after a newer one -----------------------------------------------------------


def test_old_attempt_finishing_after_a_newer_one_is_rolled_back(
    app: Celery, worker_factory: Any, db_url: str, app_tables: Engine
) -> None:
    gate, v3_running = threading.Event(), threading.Event()
    bodies: list[int] = []
    # On SQLite an open effects transaction holds the database's only write lock, so v3 may block with its
    # effects written only on PostgreSQL; on SQLite it writes them after it is released. Rows are not numbered
    # here: the counter row's lock would make v5 wait for the blocked v3.
    write_first = app_tables.dialect.name == "postgresql"

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_stale_late",
        idempotency_key="ev:{entity}:{version}",
        entity="e:{entity}",
        entity_version="version",
    )
    def apply_event(self: IdempotentTask, entity: str, version: int) -> int:
        bodies.append(version)
        if version == 3 and write_first:
            write_applied(self, entity, version, numbered=False)
        if version == 3:
            v3_running.set()
            if not gate.wait(RESULT_TIMEOUT):
                raise TimeoutError("the test never released v3")
        if not (version == 3 and write_first):
            write_applied(self, entity, version, numbered=False)
        return version

    entity = new_entity(app_tables)
    store, runs = RunStore(db_url), Runs(db_url)
    with worker_factory(app, concurrency=WORKERS):
        try:
            late = apply_event.delay(entity, 3)
            assert v3_running.wait(RESULT_TIMEOUT), "v3's body never started"
            assert apply_event.delay(entity, 5).get(timeout=RESULT_TIMEOUT) == 5
            assert store.applied_version(apply_event.name, "", f"e:{entity}") == 5
        finally:
            gate.set()
        assert late.get(timeout=RESULT_TIMEOUT) is None
        # Later copies of older versions are refused before claiming: no body, no run.
        assert apply_event.delay(entity, 3).get(timeout=RESULT_TIMEOUT) is None
        assert apply_event.delay(entity, 4).get(timeout=RESULT_TIMEOUT) is None

    assert bodies == [3, 5]
    assert applied_rows(app_tables, entity) == [(0, 5)]  # v3's effects rolled back
    assert store.applied_version(apply_event.name, "", f"e:{entity}") == 5
    v3 = runs.get(apply_event.name, f"ev:{entity}:3")
    assert v3 is not None and v3.status is RunStatus.COMPLETED and v3.result is None and v3.token == 1
    v5 = runs.get(apply_event.name, f"ev:{entity}:5")
    assert v5 is not None and v5.status is RunStatus.COMPLETED and v5.result == 5
    assert runs.get(apply_event.name, f"ev:{entity}:4") is None
    assert apply_event.outcome_counts() == {"executed": 1, "stale": 3}


# -- 3. bad input ---------------------------------------------------------------------------------------------


# An integral float (3.0) is version 3: arguments are normalised to one JSON form (oncelery.keys).
@pytest.mark.parametrize("bad", ["3", 3.5, True, None], ids=["str", "float", "bool", "none"])
def test_non_int_version_is_refused_at_delay(app: Celery, published: list[str], bad: Any) -> None:
    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_stale_badversion",
        idempotency_key="ev:{entity}:{version}",
        entity="e:{entity}",
        entity_version="version",
    )
    def apply_event(self: IdempotentTask, entity: str, version: Any) -> Any:
        return version

    with pytest.raises(ConfigurationError, match="entity_version argument 'version' must be an int"):
        apply_event.delay("a", bad)
    with pytest.raises(ConfigurationError, match="must be an int"):
        apply_event.apply_async(kwargs={"entity": "a", "version": bad})
    assert published == []
    assert redis_cli("-n", app.conf.broker_url.rsplit("/", 1)[1], "LLEN", app.conf.task_default_queue) == "0"


def _define(app: Celery, fn: Any, **options: Any) -> Any:
    # A fresh name each time: Celery hands back the registered task for a name it already has.
    name = f"oncelery.t_stale_def_{uuid.uuid4().hex[:8]}"
    return app.task(shared=False, base=IdempotentTask, bind=True, name=name, **options)(fn)


def _event(self: IdempotentTask, entity: str, version: int) -> int:
    return version


def test_entity_version_options_are_checked_at_task_creation(redis_url: str) -> None:
    app = Celery("stale-definitions", broker=redis_url)
    app.finalize()  # tasks are created at definition, not lazily at first use
    try:
        with pytest.raises(ConfigurationError, match=r"entity_version='revision' is not a parameter"):
            _define(app, _event, idempotency_key=KEY, entity="e:{entity}", entity_version="revision")
        with pytest.raises(ConfigurationError, match="entity_version needs an entity"):
            _define(app, _event, idempotency_key=KEY, entity_version="version")
        with pytest.raises(ConfigurationError, match="entity= orders events only with entity_version="):
            _define(app, _event, idempotency_key=KEY, entity="e:{entity}")
        # The controls: an entity, or a concurrency_key standing for it, makes a valid definition.
        ok = _define(app, _event, idempotency_key=KEY, entity="e:{entity}", entity_version="version")
        assert ok.version_of(("a", 2)).version == 2 and ok.version_of(("a", 2)).entity == "e:a"
        ck = _define(app, _event, idempotency_key=KEY, concurrency_key="c:{entity}", entity_version="version")
        assert ck.version_of(("b", 7)).entity == "c:b"
    finally:
        app.close()
