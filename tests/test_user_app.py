"""The sample user app (tests/user_app/shop.py), tested only through oncelery.testing: what a user would write.

Fixtures from the plugin: oncelery_db (a fresh migrated schema per test: SQLite, or PostgreSQL with
--oncelery-db-url / $ONCELERY_TEST_DATABASE_URL), oncelery_worker (in-process), oncelery_worker_process
(real `celery worker` subprocesses), oncelery_pass_through. The only fixture of our own says which app.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select

from oncelery import Outcome, outcome_of
from oncelery.testing import (
    ANY,
    OnceleryDb,
    StepFailedOnce,
    assert_ledger,
    assert_outcomes,
    assert_ran_once,
    assert_steps,
    deliver_concurrently,
    fail_step_once,
    flush_broker,
    frozen_past_lease,
    kill_holder,
    wait_until,
)

REDIS = os.environ.get("ONCELERY_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
os.environ.setdefault("SHOP_BROKER_URL", REDIS)
os.environ.setdefault("SHOP_RESULT_BACKEND", REDIS)
# A queue of this module's own (Celery fixes an app's queues at its first send; subprocess workers inherit it).
os.environ.setdefault("SHOP_QUEUE", f"shop-{uuid.uuid4().hex[:10]}")

from tests.user_app import shop  # noqa: E402  (configured from the environment above)

APP_PATH = "tests.user_app.shop:app"
# The shop's own effect: one charge row per order (the key is "charge:{order_id}").
CHARGES = "SELECT count(*) FROM shop_charges WHERE 'charge:' || order_id = :key"
TIMEOUT = 90


@pytest.fixture
def oncelery_app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """The user's app (the only fixture a user writes: which app); bodies may be held by flag files here."""
    monkeypatch.setenv("SHOP_HOLD_DIR", str(tmp_path))
    return shop.app


@pytest.fixture
def shop_db(oncelery_db: OnceleryDb) -> OnceleryDb:
    """oncelery_db with the shop's own table created (as the user's migrations would)."""
    engine = create_engine(oncelery_db.url)
    shop.metadata.create_all(engine)
    engine.dispose()
    return oncelery_db


def charges_of(db: OnceleryDb, order_id: str) -> int:
    return db.count("SELECT count(*) FROM shop_charges WHERE order_id = :o", o=order_id)


def test_a_duplicate_storm_of_20_gives_one_effect(oncelery_app: Any, shop_db: OnceleryDb, oncelery_worker: Any) -> None:
    results = deliver_concurrently(shop.charge, "o-1", 30, times=20)
    values = [r.get(timeout=TIMEOUT) for r in results]
    assert values == [{"order_id": "o-1", "amount": 30, "risk": "low"}] * 20
    assert_ran_once(shop_db, shop.charge, "charge:o-1", effects=CHARGES)
    assert_ledger(shop_db, shop.charge, "charge:o-1", calls=1)  # one model call for 20 deliveries
    assert_outcomes(shop_db, shop.charge, executed=1, replayed=19, in_progress=ANY)  # waits, then replays
    outcomes = [outcome_of(r) for r in results]
    assert outcomes.count(Outcome.EXECUTED) == 1 and outcomes.count(Outcome.REPLAYED) == 19, outcomes


def test_killing_the_holder_gives_one_effect_and_resumed(
    oncelery_app: Any, shop_db: OnceleryDb, oncelery_worker_process: Any
) -> None:
    # No visibility timeout to shorten, no lease to wait out: the kit's workers take short ones, and kill_holder
    # gives the dead holder's job back at once.
    hold = Path(os.environ["SHOP_HOLD_DIR"]) / "o-2"
    hold.touch()  # the first holder stops after its first step, until the test lets it go
    first = oncelery_worker_process(APP_PATH)
    result = shop.charge.delay("o-2", 40)
    kill_holder(first, shop_db, shop.charge, "charge:o-2", after_steps=1)
    hold.unlink()
    oncelery_worker_process(APP_PATH)  # a second worker gets the job back and resumes it
    assert result.get(timeout=TIMEOUT) == {"order_id": "o-2", "amount": 40, "risk": "low"}
    assert_ran_once(shop_db, shop.charge, "charge:o-2", effects=CHARGES)
    assert outcome_of(result) is Outcome.RESUMED
    assert_steps(shop_db, shop.charge, "charge:o-2", executed=["score"], replayed=["fetch"])
    assert_ledger(shop_db, shop.charge, "charge:o-2", calls=1)  # killed before its call: made once


def test_an_expired_lease_is_taken_over_and_the_zombie_is_refused(
    oncelery_app: Any, shop_db: OnceleryDb, oncelery_worker_process: Any
) -> None:
    hold = Path(os.environ["SHOP_HOLD_DIR"]) / "o-3"
    hold.touch()
    zombie = oncelery_worker_process(APP_PATH, hostname="zombie@%h")
    first = shop.charge.delay("o-3", 50)
    # Frozen once its first step is checkpointed (it then waits on the hold file): the taker resumes from it.
    with frozen_past_lease(zombie, shop_db, shop.charge, "charge:o-3", after_steps=1):
        hold.unlink()
        oncelery_worker_process(APP_PATH, hostname="taker@%h")
        # A duplicate reaches the second worker, finds the lease expired and takes the run over.
        second = shop.charge.delay("o-3", 50)
        assert second.get(timeout=TIMEOUT) == {"order_id": "o-3", "amount": 50, "risk": "low"}
        assert outcome_of(second) is Outcome.RESUMED  # its first step was checkpointed by the zombie
    # Released, the zombie finishes its body; its completion is fenced out (lease_lost) and the job is sent
    # again, to be answered from the taker's result.
    assert first.get(timeout=TIMEOUT) == {"order_id": "o-3", "amount": 50, "risk": "low"}
    # `first`'s result may come first from a copy of its message the broker gave back while the zombie was
    # frozen (the kit's short visibility timeout): wait for the zombie's own refused completion.
    wait_until(lambda: shop_db.outcome_counts(shop.charge).get("lease_lost"), what="the zombie's lease_lost")
    run = assert_ran_once(shop_db, shop.charge, "charge:o-3", effects=CHARGES)
    assert run.token == 2
    counts = shop_db.outcome_counts(shop.charge)
    assert counts["lease_lost"] == 1 and counts["resumed"] == 1 and "executed" not in counts, counts


def test_a_step_that_fails_once_resumes_from_the_checkpoint(
    oncelery_app: Any, shop_db: OnceleryDb, oncelery_worker: Any
) -> None:
    with fail_step_once(shop.charge, "score") as failed, pytest.raises(StepFailedOnce):
        shop.charge.delay("o-4", 60).get(timeout=TIMEOUT)
    assert failed == ["charge:o-4"]
    result = shop.charge.delay("o-4", 60)
    assert result.get(timeout=TIMEOUT)["risk"] == "low"
    assert_ran_once(shop_db, shop.charge, "charge:o-4", effects=CHARGES)
    assert_steps(shop_db, shop.charge, "charge:o-4", executed=["score"], replayed=["fetch"])
    assert_outcomes(shop_db, shop.charge, failed=1, resumed=1)


def test_a_broker_flushed_mid_run_still_gives_one_effect(
    oncelery_app: Any, shop_db: OnceleryDb, oncelery_worker: Any
) -> None:
    hold = Path(os.environ["SHOP_HOLD_DIR"]) / "o-6"
    hold.touch()
    result = shop.charge.delay("o-6", 80)
    wait_until(lambda: shop_db.steps(shop.charge, "charge:o-6")[0] == ["fetch"], what="the body to hold")
    flush_broker(oncelery_app)  # the queue, the unacked bookkeeping and the results are gone
    hold.unlink()
    wait_until(lambda: charges_of(shop_db, "o-6") == 1, what="the held run to commit its charge")
    assert_ran_once(shop_db, shop.charge, "charge:o-6", effects=CHARGES)
    assert result.get(timeout=TIMEOUT)["risk"] == "low"  # stored after the flush, by the worker holding it
    assert outcome_of(result) is Outcome.EXECUTED
    # A re-send of the job (as a producer would after losing the broker) is answered, not re-run.
    again = shop.charge.delay("o-6", 80)
    assert again.get(timeout=TIMEOUT) == {"order_id": "o-6", "amount": 80, "risk": "low"}
    assert outcome_of(again) is Outcome.REPLAYED
    assert charges_of(shop_db, "o-6") == 1


def test_with_the_pass_through_switch_a_unit_test_calls_the_body(
    shop_db: OnceleryDb, oncelery_pass_through: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(shop.app.conf, "oncelery_database_url", shop_db.url)
    assert shop.charge("o-5", 70) == {"order_id": "o-5", "amount": 70, "risk": "low"}
    assert shop.charge("o-5", 70)["risk"] == "low"  # no claim: the body runs every time
    assert charges_of(shop_db, "o-5") == 2
    assert shop_db.run(shop.charge, "charge:o-5") is None  # nothing claimed, nothing stored
    engine = create_engine(shop_db.url)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(shop.charges)).scalar_one() == 2
    engine.dispose()
