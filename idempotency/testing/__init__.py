"""oncelery.testing: a pytest plugin that proves a user's own task is exactly-once, on real workers.

Loaded only where a project asks for it, as Celery's own pytest plugin is: `pytest_plugins = ["oncelery.testing"]`
in the rootdir's conftest.py, or `pytest -p oncelery.testing` (or `addopts`). Installing Oncelery registers
nothing with pytest, so an unrelated pytest run of the environment never imports it. It builds on
pytest-celery's Celery app fixtures (`celery_app`, `celery_config`) where a project uses them. Fixtures:

- `oncelery_db`: a fresh migrated claims schema: a new database on PostgreSQL (`--oncelery-db-url` or
  $ONCELERY_TEST_DATABASE_URL, else the local server if it answers; names prefixed by `--oncelery-db-prefix`),
  else a temporary SQLite file.
- `oncelery_app`: the Celery app under test; override it to return yours (default: pytest-celery's `celery_app`).
- `oncelery_worker`: a real in-process worker (threads) of that app on `oncelery_db`.
- `oncelery_worker_process`: a factory of real `celery worker` subprocesses (for kills and freezes).
- `oncelery_pg_cluster`, `oncelery_cluster_db`: a throwaway PostgreSQL cluster per session, and a database on it.

Every worker of the kit uses the test database whatever the app configures, or refuses at once naming both, and
so does the test process while a kit worker runs: `isolated(app, url)` (which the workers use) gives the app
the test's database, queues of the test's own namespace and results under it, then the app's settings back, so a
developer's worker running beside the tests takes none of their jobs.

Fault helpers are one-liners: `deliver_concurrently`, `kill_holder`, `frozen_past_lease`, `expire_lease`,
`flush_broker` (this app's queues only), `fail_step_once` (`exc=` your own error), and the database's:
`fail_at(point, fault)`, `terminate_connections`, `database_down`. Assertions: `assert_ran_once`,
`assert_outcomes` (`ANY` or `ignore=` for timing-dependent counts), `assert_steps`, `assert_ledger`.
Model calls: `FakeProvider` (a real HTTP server on 127.0.0.1 speaking OpenAI's and Anthropic's protocols, whose
counters are what a provider would have billed; docs/llm.md), `FakeProviderControl`, `FakeProviderKnobs`.
$ONCELERY_PASS_THROUGH=1 (fixture `oncelery_pass_through`) runs bodies unclaimed for plain unit tests
(`self.run_id` is None there). `relay_running(app, url)` runs the relay in a thread: a run parked WAITING on a
long model call wakes only through a relay, in tests as in production. See docs/testing.md.

Reading order: `plugin` (fixtures and options), `db` (reads and assertions), `faults` (delivery faults),
`isolation` (the test's database, queues and results, for the test process and its workers), `worker` (the
subprocess), `broker` (Redis), `database_faults`, `cluster` (the throwaway PostgreSQL), `waiting`. This module
re-exports them: it is the plugin pytest loads, and `from oncelery.testing import *` gives the kit.

PYTEST_DONT_REWRITE: the kit's checks raise AssertionError themselves (they hold under `python -O`), so pytest
need not rewrite this module, and a conftest.py may import from it before its `pytest_plugins` line names it.
"""

from oncelery.fake_provider import FakeProvider, FakeProviderControl
from oncelery.fake_provider import Knobs as FakeProviderKnobs
from oncelery.testing.broker import TEST_VISIBILITY_TIMEOUT, flush_broker, restore_delivery
from oncelery.testing.database_faults import InjectedFault, database_down, fail_at, terminate_connections
from oncelery.testing.db import ANY, OnceleryDb, assert_ledger, assert_outcomes, assert_ran_once, assert_steps
from oncelery.testing.faults import (
    StepFailedOnce,
    deliver_concurrently,
    expire_lease,
    fail_step_once,
    frozen_past_lease,
    kill_holder,
)
from oncelery.testing.isolation import isolated

# The plugin's fixtures, hook and constants, read by pytest from this module (the plugin `oncelery`); not part of
# `from oncelery.testing import *`, which would make every fixture a fixture of the importing module too.
from oncelery.testing.plugin import (  # noqa: F401
    DEFAULT_DB_PREFIX,
    DEFAULT_TEST_SERVER,
    ENV_TEST_DATABASE_URL,
    ENV_TEST_DB_PREFIX,
    TEST_WORKER_POLL,
    _oncelery_server,
    _oncelery_templates,
    in_process_worker,
    oncelery_app,
    oncelery_cluster_db,
    oncelery_db,
    oncelery_pass_through,
    oncelery_pg_cluster,
    oncelery_worker,
    oncelery_worker_process,
    pytest_addoption,
    running_worker,
)
from oncelery.testing.relay import relay_running
from oncelery.testing.waiting import DEFAULT_TIMEOUT, wait_until
from oncelery.testing.worker import WorkerDatabaseMismatch, WorkerProcess

__all__ = [
    "ANY",
    "DEFAULT_TIMEOUT",
    "TEST_VISIBILITY_TIMEOUT",
    "FakeProvider",
    "FakeProviderControl",
    "FakeProviderKnobs",
    "InjectedFault",
    "OnceleryDb",
    "StepFailedOnce",
    "WorkerDatabaseMismatch",
    "WorkerProcess",
    "assert_ledger",
    "assert_outcomes",
    "assert_ran_once",
    "assert_steps",
    "database_down",
    "deliver_concurrently",
    "expire_lease",
    "fail_at",
    "fail_step_once",
    "flush_broker",
    "frozen_past_lease",
    "in_process_worker",
    "isolated",
    "kill_holder",
    "relay_running",
    "restore_delivery",
    "running_worker",
    "terminate_connections",
    "wait_until",
]
