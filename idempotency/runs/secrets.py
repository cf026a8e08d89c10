"""The secrets a claims database generates for itself (table oncelery_secrets), read once per process.

- `digest_key` (migration 0004): keys the per-field digests that name a conflict's fields, unless
  ONCELERY_DIGEST_KEY is set. It may rotate: older runs' conflicts then name no fields.
- `identity_key`: keys every fingerprint and content-addressed key. It never rotates (a new one would make the
  same arguments a new key, and run them again), so it is generated here, by the first process that needs it,
  and not taken from the environment. Beside it, `legacy_runs_upto`: the highest run id at that moment. Runs up
  to it were stored before keyed digests and may hold the old forms (runs/legacy.py looks them up); a database
  created by this version records 0.

Threat model (docs/concepts.md, "What a stored fingerprint reveals"): the identity key lives in the same database
as the digests it keys. It protects what leaves the database without the oncelery_secrets table (logs, Flower,
results, dead letters shown or exported, the replay cache, a copy of task_runs); it does not protect against
someone who reads that table too.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass

from sqlalchemy import func, select

from oncelery.errors import StoreError
from oncelery.models import DIGEST_KEY_SECRET
from oncelery.settings import IDENTITY_KEY_SECRET, LEGACY_RUNS_SECRET
from oncelery.store.database import Database
from oncelery.store.tables import RUNS, SECRETS

__all__ = ["IdentitySecret", "Secrets"]


@dataclass(frozen=True)
class IdentitySecret:
    """The identity key, and the highest run id stored before it existed (0: no run holds the old forms)."""

    key: bytes
    legacy_upto: int


class Secrets:
    """This database's generated secrets: each read once per process (the identity key created if missing)."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._digest_key: bytes | None = None
        self._identity: IdentitySecret | None = None
        self._lock = threading.Lock()

    def digest_key(self) -> bytes | None:
        """The secret this database generated for per-field digests (read once), or None if it has none."""
        if self._digest_key is None:
            value = self._read([DIGEST_KEY_SECRET]).get(DIGEST_KEY_SECRET)
            self._digest_key = value.encode("utf-8") if value else b""
        return self._digest_key or None

    def identity(self) -> IdentitySecret:
        """The identity key (generated on first use, then the same for every process, for ever) and its mark."""
        if self._identity is None:
            with self._lock:
                if self._identity is None:
                    self._identity = self._read_identity() or self._create_identity()
        return self._identity

    def _read_identity(self) -> IdentitySecret | None:
        values = self._read([IDENTITY_KEY_SECRET, LEGACY_RUNS_SECRET])
        key, upto = values.get(IDENTITY_KEY_SECRET), values.get(LEGACY_RUNS_SECRET)
        if not key or upto is None:
            return None
        return IdentitySecret(key.encode("utf-8"), int(upto))

    def _create_identity(self) -> IdentitySecret:
        """Insert the identity key and the legacy mark unless another process did first; return the stored pair."""
        with self.db.begin() as conn:
            upto = conn.execute(select(func.coalesce(func.max(RUNS.c.id), 0))).scalar_one()
            insert = self.db.dialect.insert
            for name, value in ((IDENTITY_KEY_SECRET, secrets.token_hex(32)), (LEGACY_RUNS_SECRET, str(upto))):
                row = insert(SECRETS).values(name=name, value=value)
                conn.execute(row.on_conflict_do_nothing(index_elements=["name"]))
        stored = self._read_identity()
        if stored is None:  # both rows were just written, by this transaction or a concurrent one
            raise StoreError(
                "The identity key was written to oncelery_secrets but cannot be read back: check that the database "
                "user can read and write oncelery_secrets (created by `oncelery db upgrade`)"
            )
        return stored

    def _read(self, names: list[str]) -> dict[str, str]:
        with self.db.read() as conn:
            rows = conn.execute(select(SECRETS.c.name, SECRETS.c.value).where(SECRETS.c.name.in_(names)))
            return {str(name): str(value) for name, value in rows}
