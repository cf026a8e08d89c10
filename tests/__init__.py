"""Oncelery's own test suite (a package: its modules import each other as `tests.*`).

Under `pytest -n N` (pytest-xdist) each worker process gets a Redis database and a PostgreSQL session database
of its own: worker gwK takes the Redis database K above ONCELERY_TEST_REDIS_URL's (11 by default) and the session
database's name with `_gwK` appended. Set here, before conftest.py or any test module reads them, and inherited
by every process a test starts (which may import this package again: the marker makes it happen once). Some
tests flush their Redis database or truncate the session database, the relay publishes every outbox row it
finds, and Celery's broadcasts reach every worker on one Redis database. Throwaway clusters, the kit's
databases, queues, ports and folders are already per process or per test.
"""

import os
import re

_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_MARKER = "ONCELERY_TEST_XDIST_WORKER"  # which worker's names this environment already holds
if _XDIST_WORKER.startswith("gw") and os.environ.get(_MARKER) != _XDIST_WORKER:
    os.environ[_MARKER] = _XDIST_WORKER
    _k = int(_XDIST_WORKER[2:])
    _redis = os.environ.get("ONCELERY_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
    _db = re.search(r"/(\d+)$", _redis)
    _redis = f"{_redis[: _db.start()]}/{int(_db.group(1)) + _k}" if _db else f"{_redis.rstrip('/')}/{_k}"
    os.environ["ONCELERY_TEST_REDIS_URL"] = _redis
    # The controller's conftest named one session database for all (tests/services.py): one per worker instead.
    _pg = os.environ.get("ONCELERY_TEST_PG_DB", f"oncelery_test_{os.getppid()}")
    os.environ["ONCELERY_TEST_PG_DB"] = f"{_pg}_{_XDIST_WORKER}"
