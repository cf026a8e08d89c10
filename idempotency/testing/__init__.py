"""oncelery.testing: a pytest plugin that proves a user's own task is exactly-once, on real workers.

Registered as the pytest plugin `oncelery` (entry point `pytest11`), so installing Oncelery makes its fixtures
available; it builds on pytest-celery's Celery app fixtures (`celery_app`, `celery_config`) where a project uses
them. Fixtures:

- `oncelery_db`: a fresh migrated claims schema, on a temporary SQLite file, or on a fresh database created on
  the PostgreSQL server given by `--oncelery-db-url` or $ONCELERY_TEST_DATABASE_URL (dropped afterwards).
- `oncelery_app`: the Celery app under test; override it to return yours (default: pytest-celery's `celery_app`).
- `oncelery_worker`: a real in-process worker (threads) of that app on `oncelery_db`.
- `oncelery_worker_process`: a factory of real `celery worker` subprocesses (for kills and freezes).

Fault helpers are one-liners: `deliver_concurrently`, `kill_holder`, `frozen_past_lease`, `expire_lease`,
`flush_broker`, `fail_step_once` (`exc=` your own error). Assertions: `assert_ran_once`, `assert_outcomes`
(`ANY` or `ignore=` for timing-dependent counts), `assert_steps`, `assert_ledger`. $ONCELERY_PASS_THROUGH=1
(fixture `oncelery_pass_through`) runs bodies unclaimed for plain unit tests (`self.run_id` is None there).
See docs/testing.md.

Reading order: `plugin` (fixtures and options), `db` (reads and assertions), `faults` (faults and worker
subprocesses). This module re-exports them: it is the plugin pytest loads (entry point `pytest11`), and
`from oncelery.testing import *` gives the kit.
"""

from oncelery.testing.db import ANY, OnceleryDb, assert_ledger, assert_outcomes, assert_ran_once, assert_steps
from oncelery.testing.faults import (
    DEFAULT_TIMEOUT,  # noqa: F401  (the kit's default bound, imported by users' tests)
    StepFailedOnce,
    WorkerProcess,
    deliver_concurrently,
    expire_lease,
    fail_step_once,
    flush_broker,
    frozen_past_lease,
    kill_holder,
    wait_until,
)

# The plugin's fixtures, hook and constants, read by pytest from this module (the plugin `oncelery`); not part of
# `from oncelery.testing import *`, which would make every fixture a fixture of the importing module too.
from oncelery.testing.plugin import (  # noqa: F401
    ENV_TEST_DATABASE_URL,
    TEST_WORKER_POLL,
    in_process_worker,
    oncelery_app,
    oncelery_db,
    oncelery_pass_through,
    oncelery_worker,
    oncelery_worker_process,
    pytest_addoption,
    running_worker,
)

__all__ = [
    "ANY",
    "OnceleryDb",
    "StepFailedOnce",
    "WorkerProcess",
    "assert_ledger",
    "assert_outcomes",
    "assert_ran_once",
    "assert_steps",
    "deliver_concurrently",
    "expire_lease",
    "fail_step_once",
    "flush_broker",
    "frozen_past_lease",
    "in_process_worker",
    "kill_holder",
    "running_worker",
    "wait_until",
]
