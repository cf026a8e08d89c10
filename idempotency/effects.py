"""The fenced effects of one run: a session whose writes commit only with the run's completion.

`IdempotentTask.effects()` hands out this scope's session; `RunStore.complete` writes the completion in the
same transaction and commits it only if the fencing token still holds, so a zombie's effects roll back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from oncelery.store import translated

if TYPE_CHECKING:
    from oncelery.claims import RunStore


class EffectsScope:
    """The effects of one run: opened by the first `effects()` block, committed by the completion."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.session: Session | None = None

    @contextmanager
    def block(self) -> Iterator[Session]:
        """Yield the run's effects session; flush at the end (driver errors become typed store errors)."""
        if self.session is None:
            self.session = Session(self.store.engine, expire_on_commit=False)
        session = self.session
        try:
            yield session
            with translated(self.store.url):
                session.flush()
        except BaseException:
            session.rollback()
            raise

    def discard(self) -> None:
        """Roll back and close the session (after a failure, a lost lease, or a store fault)."""
        if self.session is not None:
            self.session.rollback()
            self.session.close()
            self.session = None
