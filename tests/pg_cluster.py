"""The throwaway PostgreSQL cluster of the test kit (`oncelery.testing.cluster`), for this repository's tests.

The cluster itself ships in the kit, so users' tests get it too; this module keeps the names the suite imports
(`PgCluster`, `postgres_bindir`, ...) and the session-scoped `pg_cluster` fixture (registered in
tests/conftest.py). That fixture is the kit's `oncelery_pg_cluster`, one cluster per session whichever name a
test asks for, except that a machine without PostgreSQL's server binaries fails the test in CI instead of
skipping it.
"""

from __future__ import annotations

import pytest

from oncelery.testing.cluster import (  # noqa: F401  (the names the suite imports from here)
    PG_CTL_TIMEOUT,
    SUPERUSER,
    PgCluster,
    _alive,
    _children,
    free_port,
    missing_binaries,
    postgres_bindir,
    postgres_runnable,
    postgres_user_exists,
)
from tests import services


@pytest.fixture(scope="session")
def pg_cluster(request: pytest.FixtureRequest) -> PgCluster:
    """One throwaway PostgreSQL cluster for the test session (the kit's `oncelery_pg_cluster`).

    Tests share it, never a database: each takes a fresh one (`create_database`) and drops it after.
    """
    why = missing_binaries()
    services.need("PostgreSQL binaries", why is None, why or "")
    cluster: PgCluster = request.getfixturevalue("oncelery_pg_cluster")
    return cluster
