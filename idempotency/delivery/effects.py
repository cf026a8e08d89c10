"""The fenced effects of one run: writes that commit only with the run's completion, never on their own.

The store owns the transaction: the first `effects()` block opens a connection and BEGINs; every block gets
a Session joined to that transaction with `join_transaction_mode="create_savepoint"` (SQLAlchemy's "join a
Session into an external transaction" recipe). So:
- each block is a SAVEPOINT: an error caught by the body rolls back that block only;
- a user's `session.commit()` only releases the block's savepoint: nothing reaches the database before
  `RunStore.complete` writes the token-fenced completion in the same transaction and commits it;
- a zombie's (stale token's) completion is refused, and the whole transaction, effects included, rolls back.

A fork's run (runs/forks.py) never writes production by default: under `dry` each block is flushed (so the
body sees its own writes, constraints included) and then rolled back to its savepoint, outbox rows with it, so
nothing is published; under `shadow` each block is written to the database the fork names (`shadow_url`) and
committed there when the block ends (production's relay never reads that outbox); `live` is production's path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from oncelery.errors import ConfigurationError
from oncelery.runs.faults import fault_point
from oncelery.store.database import get_engine, translated

if TYPE_CHECKING:
    from oncelery.runs.claims import RunStore
    from oncelery.runs.forks import ForkSpec

__all__ = [
    "EffectsScope",
]

logger = logging.getLogger("oncelery.effects")  # a stable name (users filter on it)


class EffectsScope:
    """The effects transaction of one run: opened by the first `effects()` block, ended by the completion."""

    def __init__(self, store: RunStore, fork: ForkSpec | None = None) -> None:
        self.store = store
        self.connection: Connection | None = None
        self.mode = "live" if fork is None else fork.effects
        self.shadow_url = None if fork is None else fork.shadow_url

    def _begin(self) -> Connection:
        if self.connection is None:
            fault_point("effects_begin")
            with translated(self.store.url):
                conn = self.store.engine.connect()
                try:
                    conn.begin()  # committed by Connection.commit() in RunStore.complete
                except BaseException:
                    conn.close()
                    raise
            self.connection = conn
        return self.connection

    @contextmanager
    def block(self) -> Iterator[Session]:
        """Yield a Session whose writes form one savepoint of the run's effects transaction."""
        conn = self._begin()
        if self.mode == "shadow":
            with self._shadow_block() as session:
                yield session
            return
        session = Session(bind=conn, join_transaction_mode="create_savepoint", expire_on_commit=False)
        try:
            # The body's own statements are store calls too: a disconnect or lock timeout in them is a
            # StoreUnavailable (the job is sent again), never mistaken for the body failing.
            with translated(self.store.url):
                yield session
                fault_point("effects_flush")
                if self.mode == "dry":  # a dry fork: written, checked by the database, then rolled back
                    session.flush()
                    session.rollback()
                else:
                    session.commit()  # flushes, then RELEASEs the block's savepoint: the outer transaction stays open
        except BaseException:
            try:
                session.rollback()  # back to the block's savepoint only
            except Exception as exc:  # a dead connection cannot roll back; the error in flight is what counts
                logger.debug("effects rollback failed: %s", exc)
            raise
        finally:
            session.close()

    @contextmanager
    def _shadow_block(self) -> Iterator[Session]:
        """A shadow fork's block: its own transaction on the shadow database, committed when the block ends."""
        url = self.shadow_url
        if not url:
            raise ConfigurationError("a shadow fork needs a shadow database: give --shadow-url (oncelery fork)")
        with (
            translated(url),
            get_engine(url).connect() as shadow,
            shadow.begin(),
            Session(bind=shadow, join_transaction_mode="create_savepoint", expire_on_commit=False) as session,
        ):
            yield session
            fault_point("effects_flush")
            session.commit()

    def discard(self) -> None:
        """Roll back every block and return the connection (after a failure, a lost lease, a store fault)."""
        conn, self.connection = self.connection, None
        if conn is not None:
            try:
                conn.rollback()
            finally:
                conn.close()

    def close(self) -> None:
        """Return the connection after the completion committed (or rolled back) its transaction."""
        conn, self.connection = self.connection, None
        if conn is not None:
            conn.close()
