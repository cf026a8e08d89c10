"""A user's app configured from its own celeryconfig (tests/user_app/labelsconfig.py), as the README shows:
one task that labels a document in two checkpointed steps and writes the label with the run.

A body is held while the flag file $LABELS_HOLD_DIR/<doc> exists (a long model call, without a fixed sleep).
With $LABELS_SET_DATABASE_AT_START set, a worker_init handler sets the app's claims database once more (to
that value), as an app computing its configuration at worker start might: the test kit must refuse to run it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery, signals
from sqlalchemy import Column, Integer, MetaData, String, Table, insert

from oncelery import IdempotentTask

app = Celery("labels")
app.config_from_object("tests.user_app.labelsconfig")

metadata = MetaData()
#: The app's own table: one row per label, written through effects() so it commits with the run.
labels = Table(
    "doc_labels",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("doc", String(64), nullable=False),
    Column("label", String(32), nullable=False),
)


@signals.worker_init.connect(weak=False)
def _set_database_at_start(sender: Any = None, **_: Any) -> None:
    url = os.environ.get("LABELS_SET_DATABASE_AT_START")
    if url:
        app.conf.oncelery_database_url = url


def _hold(doc: str) -> None:
    flag = Path(os.environ.get("LABELS_HOLD_DIR", "/nonexistent")) / doc
    while flag.exists():
        time.sleep(0.05)


@app.task(base=IdempotentTask, bind=True, name="labels.label", idempotency_key="label:{doc}", shared=False)
def label(self: IdempotentTask, doc: str) -> str:
    """Label a document once: read it, hold (a slow model), classify, then store the label with the run."""
    words = self.step("read", lambda: len(doc.split("-")))
    _hold(doc)
    verdict = self.step("classify", lambda: "short" if words < 3 else "long")
    with self.effects() as session:
        session.execute(insert(labels).values(doc=doc, label=verdict))
    return str(verdict)
