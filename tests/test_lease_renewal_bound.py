"""A hung body's lease: renewed up to a bound, then left to expire, and its late completion fenced out.

The bound is max_lease, else the hard time limit (the task's, else the app's), else the soft one; with none
the heartbeat renews for as long as the body runs.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from celery import Celery

from oncelery import IdempotentTask, LeaseLost, Runs, RunStatus
from oncelery.runs.claims import RunStore
from tests.conftest import offline_job
from tests.services import wait_for


def test_hung_body_stops_renewing_and_its_late_completion_is_fenced(app: Celery, db_url: str) -> None:
    """A blocked body stops renewing after max_lease; after a takeover its late completion is refused."""
    gate, started = threading.Event(), threading.Event()

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_hung",
        idempotency_key="hung:{n}",
        lease=1,
        max_lease=2,
    )
    def hung(self: IdempotentTask, n: int) -> str:
        started.set()
        if not gate.wait(60):
            raise TimeoutError("the test never released the body")
        return "late"

    app.finalize()
    outcome: dict[str, Any] = {}

    def deliver() -> None:
        try:
            outcome["result"] = hung(1)
        except BaseException as exc:
            outcome["error"] = exc

    runs, store = Runs(db_url), RunStore(db_url)
    body = threading.Thread(target=deliver, name="hung-delivery", daemon=True)
    body.start()
    try:
        assert started.wait(30)
        first = runs.get(hung.name, "hung:1")
        assert first is not None and first.status is RunStatus.RUNNING and first.lease_expires_at is not None

        def renewed() -> bool:
            run = runs.get(hung.name, "hung:1")
            expires = run.lease_expires_at if run is not None else None
            return expires is not None and expires > first.lease_expires_at

        wait_for(renewed, timeout=10, what="the heartbeat to renew the lease (it lasts 1 s)")
        wait_for(
            lambda: (run := runs.get(hung.name, "hung:1")) is not None and not run.lease_live,
            timeout=15,
            what="the lease of the hung body to expire by the database clock after max_lease",
        )
        assert body.is_alive() and not gate.is_set()  # the body is still blocked: expiry came from max_lease

        taken = store.claim(hung.name, hung.identity_of((1,)), lease=60)
        assert taken.claim is not None and taken.claim.token == 2 and taken.claim.takeover
    finally:
        gate.set()
        body.join(30)
    assert not body.is_alive()

    assert "result" not in outcome
    assert isinstance(outcome.get("error"), LeaseLost), outcome
    run = runs.get(hung.name, "hung:1")
    assert run is not None and run.status is RunStatus.RUNNING and run.token == 2
    assert run.owner == taken.claim.owner and run.result is None and run.lease_live
    assert hung.outcome_counts() == {"lease_lost": 1}


def test_the_renewal_bound_is_max_lease_then_the_hard_then_the_soft_time_limit() -> None:
    """max_lease wins, then the hard time limit (the task's, else the app's), then the soft; none: unbounded."""
    app = Celery(f"bounds-{uuid.uuid4().hex[:6]}")
    app.conf.task_time_limit = 50
    assert offline_job(app, "oncelery.t_bound_app").max_lease_seconds() == 50.0
    assert offline_job(app, "oncelery.t_bound_hard", time_limit=30).max_lease_seconds() == 30.0
    assert offline_job(app, "oncelery.t_bound_soft", soft_time_limit=20).max_lease_seconds() == 50.0
    assert offline_job(app, "oncelery.t_bound_own", time_limit=30, max_lease=7).max_lease_seconds() == 7.0
    bare = Celery(f"unbounded-{uuid.uuid4().hex[:6]}")
    assert offline_job(bare, "oncelery.t_bound_none").max_lease_seconds() is None
    bare.conf.task_soft_time_limit = 15
    assert offline_job(bare, "oncelery.t_bound_app_soft").max_lease_seconds() == 15.0
