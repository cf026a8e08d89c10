"""A store fault at a checkpoint: loading a taken-over run's checkpoints, or saving a step's; the job ends once.

Only a taken-over run loads checkpoints, so that case first leaves a run RUNNING with step 1 checkpointed and
its lease expired (`abandon_after_first_step`). The job, the faults and the checks: tests/store_faults.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from oncelery import RunStatus, StoreError
from oncelery.runs.faults import fault_injected
from tests.services import wait_for
from tests.store_faults import FAULTS, JOB_TIMEOUT, Db, LogLines, Once, fault_at_stage_ends_once, job_key


def wait_lease_expired(db: Db, task_name: str, key: str) -> None:
    def expired() -> bool:
        run = db.run(task_name, key)
        return run is not None and run.status is RunStatus.RUNNING and not run.lease_live

    wait_for(expired, timeout=JOB_TIMEOUT, interval=0.1, what=f"the lease of {task_name}[{key}] to expire")


def abandon_after_first_step(db: Db, job: Any, n: int) -> None:
    """Leave the run RUNNING with step 1 checkpointed and its lease expired: what a takeover finds.

    Only a taken-over run loads checkpoints. A holder (a direct caller) loses its database right before its
    second checkpoint, gets StoreUnavailable, and stops renewing; then its lease runs out.
    """
    cluster = db.cluster
    assert cluster is not None
    key = job_key(n)
    lose_db = Once(lambda: cluster.terminate_backends(database=db.name), key)

    def before_second_checkpoint(name: str, ctx: dict[str, Any]) -> None:
        if ctx.get("step") == "second":
            lose_db(name, ctx)

    with fault_injected("step_save", before_second_checkpoint), pytest.raises(StoreError):
        job(n)
    assert lose_db.injected.is_set() and lose_db.error is None
    wait_lease_expired(db, job.name, key)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("stage", ["load_checkpoints", "step_save"])
def test_a_store_fault_at_each_checkpoint_stage_ends_once(
    stage: str, fault: str, pg_db: Db, pg_app: Celery, logs: LogLines
) -> None:
    before = abandon_after_first_step if stage == "load_checkpoints" else None
    fault_at_stage_ends_once(stage, fault, pg_db, pg_app, logs, before=before)
