"""Runs stored before keyed digests, injective keys and links' own keys still deduplicate: the legacy lookups.

Three changes altered how a call's identity is stored:
- keyed digests: a fingerprint and a content-addressed key were plain sha256 of canonical JSON (`sha256:<hex>`);
  they are HMAC-SHA256 under the database's identity key now (`hmac-sha256:<hex>`);
- injective keys: a template value that is a string reading as an integer ("42"), or holding "~", was written as
  it was; it is percent-encoded now ("%342", "%7E");
- links' own keys: `pipeline()` keyed every link "{pipeline key}/{position}:{task name}"; a link whose task names a
  key of its own keeps that key now (basetask/pipeline.py).

What a lookup costs, and when (the hot path pays nothing on a database that never held the old forms):
- a fingerprint stored the old way is recognised where a claim compares fingerprints (`Identity.same_payload`):
  only a run whose fingerprint differs (before: a conflict) pays, and no statement is added;
- a (tenant, key) stored the old way is looked up before the claim (one read on the unique index), only if the
  call's old form differs from its new one (content addressed, or one of those strings) AND runs from before the
  upgrade may remain: those with an id up to `legacy_runs_upto` (runs/secrets.py), asked once per
  LEGACY_RECHECK_SECONDS per process by one probe of the primary key. Once the last is purged, never again;
- an entity's version stored under its old name is looked up (one read on its primary key) only if the entity's
  old name differs and the database existed before the upgrade (entity versions are never purged);
- a pipeline link keyed by its own task is looked up under its pipeline-derived key too (one read on the unique
  index, with the claim's other reads), only if its message names its pipeline and position (a link `pipeline()`
  built): `.delay()` pays nothing. A run found there keeps that key, so the pipeline enqueued again replays it;
  `.delay()` of the same call does not know the pipeline and finds only runs stored under the task's own key;
- `oncelery.outbox.enqueue` stores the (tenant, key) a run holds, so the relay's join finds it: one read in the
  caller's transaction, only if the old form differs.

A run found in its old form is the same run: the delivery claims, replays or waits on it under its stored tenant,
key and fingerprint. Old workers do not know the new forms: finish a rolling upgrade before relying on it.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from sqlalchemy import Connection, and_, or_, select
from sqlalchemy.orm import Session

from oncelery.runs.decisions import EntityVersionOf
from oncelery.runs.keys import CallKey, Identity, StoredBefore
from oncelery.runs.secrets import Secrets
from oncelery.settings import LEGACY_RECHECK_SECONDS
from oncelery.store.database import Database
from oncelery.store.tables import RUNS, VERSIONS

__all__ = ["LegacyRuns", "stored_names"]


class LegacyRuns:
    """Finds the run (or entity version) a call left in the forms stored before the upgrade, when one may exist."""

    def __init__(self, db: Database, secrets: Secrets) -> None:
        self.db = db
        self.secrets = secrets
        self._possible = True
        self._ask_after = 0.0  # monotonic time of the next probe; math.inf once no old run remains
        self._lock = threading.Lock()

    def possible(self) -> bool:
        """Whether runs stored before the upgrade may remain (cached; probed once per LEGACY_RECHECK_SECONDS)."""
        if time.monotonic() < self._ask_after:
            return self._possible
        with self._lock:
            if time.monotonic() >= self._ask_after:
                upto = self.secrets.identity().legacy_upto
                self._possible = upto > 0 and self._any_run_upto(upto)
                self._ask_after = time.monotonic() + LEGACY_RECHECK_SECONDS if self._possible else math.inf
        return self._possible

    def identity(self, task_name: str, ident: Identity) -> Identity:
        """The call as its run is stored: `ident`, or its old forms if only they have a run (see the module)."""
        if not ident.renamed_before() or not self.possible():
            return ident
        old = ident.as_stored_before()
        with self.db.read() as conn:
            found = _pairs_found(conn, task_name, [(ident.tenant, ident.key), (old.tenant, old.key)])
        if (ident.tenant, ident.key) in found or (old.tenant, old.key) not in found:
            return ident
        return old

    def link(self, task_name: str, ident: Identity, scoped_key: str) -> Identity:
        """The pipeline link as its run is stored: `ident`, or under `scoped_key` (its pipeline-derived key from
        before links kept their own keys) if only that has a run; the payload is compared in both forms."""
        if scoped_key == ident.key:
            return ident
        with self.db.read() as conn:
            found = _pairs_found(conn, task_name, [(ident.tenant, ident.key), (ident.tenant, scoped_key)])
        if (ident.tenant, ident.key) in found or (ident.tenant, scoped_key) not in found:
            return ident
        # The old run may predate keyed digests too: keep the unkeyed fingerprint as its other accepted form.
        before = ident.stored_before.fingerprint if ident.stored_before is not None else ident.fingerprint
        stored = StoredBefore(ident.tenant, scoped_key, before)
        return Identity(scoped_key, ident.fingerprint, ident.field_digests, ident.tenant, stored)

    def entity(self, task_name: str, tenant: str, version: EntityVersionOf | None) -> EntityVersionOf | None:
        """The entity version as it is stored: `version`, or under its old name if only that has a row."""
        if version is None or version.before is None or self.secrets.identity().legacy_upto == 0:
            return version
        v = VERSIONS.c
        names = [version.entity, version.before]
        stmt = select(v.entity).where(v.task_name == task_name, v.tenant == tenant, v.entity.in_(names))
        with self.db.read() as conn:
            found = {str(name) for name in conn.execute(stmt).scalars()}
        if version.entity in found or version.before not in found:
            return version
        return EntityVersionOf(version.before, version.version)

    def _any_run_upto(self, upto: int) -> bool:
        with self.db.read() as conn:
            return conn.execute(select(RUNS.c.id).where(RUNS.c.id <= upto).limit(1)).first() is not None


def stored_names(session: Session | Connection, task_name: str, call: CallKey) -> tuple[str | None, str]:
    """The (key, tenant) a run of this call holds: its old forms if only they have a run, else the call's own.

    Read in the caller's transaction (the outbox's), so the row stores what the worker's claim will find.
    """
    if call.key is None or not call.renamed_before():
        return call.key, call.tenant
    old = (call.tenant_before or call.tenant, call.key_before or call.key)
    found = _pairs_found(session, task_name, [(call.tenant, call.key), old])
    if (call.tenant, call.key) in found or old not in found:
        return call.key, call.tenant
    return old[1], old[0]


def _pairs_found(conn: Any, task_name: str, pairs: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """Which of the (tenant, key) pairs of `task_name` have a run (one read on the unique index)."""
    c = RUNS.c
    match = or_(*(and_(c.tenant == tenant, c.idempotency_key == key) for tenant, key in pairs))
    rows = conn.execute(select(c.tenant, c.idempotency_key).where(c.task_name == task_name, match))
    return {(str(tenant), str(key)) for tenant, key in rows}
