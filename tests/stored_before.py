"""Runs as the code before keyed digests and injective keys stored them: the old formulas, written out here.

An upgrade test stores a run (or an entity version) this way in a database "from before the upgrade" (no
identity key yet: the first process that needs one then records that old runs exist), and calls the task with
today's code.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from sqlalchemy import delete, insert

from oncelery import RunStatus
from oncelery.settings import IDENTITY_KEY_SECRET, LEGACY_RUNS_SECRET
from oncelery.store.database import get_engine
from oncelery.store.tables import RUNS, SECRETS, VERSIONS


def old_digest(value: Any) -> str:
    """The fingerprint before keyed digests: sha256 of canonical JSON, no key (10,000 PINs in milliseconds)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def old_content_key(arguments: dict[str, Any]) -> str:
    """A content-addressed key before keyed digests: "sha256:" + the digest of all arguments."""
    return "sha256:" + old_digest(arguments)


def old_text(value: str) -> str:
    """A template's string value before injective keys: percent-encoded, but "~" kept and "42" left as it is."""
    return quote(unicodedata.normalize("NFC", value), safe="-._")


class BeforeUpgrade:
    """Writes rows in the forms stored before the upgrade into one claims database."""

    def __init__(self, db_url: str) -> None:
        self.engine = get_engine(db_url)

    def forget_identity_key(self) -> None:
        """Make the database one from before keyed digests: it holds no identity key (nor its legacy mark)."""
        with self.engine.begin() as conn:
            conn.execute(delete(SECRETS).where(SECRETS.c.name.in_([IDENTITY_KEY_SECRET, LEGACY_RUNS_SECRET])))

    def run(
        self,
        task_name: str,
        key: str,
        fingerprint: str,
        *,
        tenant: str = "",
        status: RunStatus = RunStatus.COMPLETED,
        result: Any = None,
    ) -> int:
        """Store a run as the old code did (key and fingerprint given in their old forms); return its id."""
        row = {
            "task_name": task_name,
            "tenant": tenant,
            "idempotency_key": key,
            "fingerprint": fingerprint,
            "field_digests": {},
            "status": status,
            "fencing_token": 1,
            "owner": "old-worker",
            "attempts": 1,
            "result": result,
        }
        with self.engine.begin() as conn:
            return int(conn.execute(insert(RUNS).values(**row).returning(RUNS.c.id)).scalar_one())

    def entity_version(self, task_name: str, entity: str, version: int, tenant: str = "") -> None:
        """Store an entity's applied version under its old name."""
        with self.engine.begin() as conn:
            conn.execute(insert(VERSIONS).values(task_name=task_name, tenant=tenant, entity=entity, version=version))


@pytest.fixture
def before_upgrade(db_url: str) -> Iterator[BeforeUpgrade]:
    """A claims database from before the upgrade (no identity key); forgotten again after the test, so the next
    one on the session's PostgreSQL database starts as a new database (its identity key records no old runs)."""
    old = BeforeUpgrade(db_url)
    old.forget_identity_key()
    yield old
    old.forget_identity_key()


def old_link_key(pipeline_key: str, position: int, task_name: str) -> str:
    """A pipeline link's key before links kept their task's own key: the pipeline key, position and task name."""
    return f"{pipeline_key}/{position}:{task_name}"
