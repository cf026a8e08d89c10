"""A developer's notes app configured from its own celeryconfig (tests/user_app/notesconfig.py): an indexing
task, and a digest debounced per document (a burst of edits makes one run) routed to a queue of its own.
"""

from __future__ import annotations

from celery import Celery

from oncelery import Debounce, IdempotentTask

app = Celery("notes")
app.config_from_object("tests.user_app.notesconfig")


@app.task(base=IdempotentTask, bind=True, name="notes.index", idempotency_key="index:{doc}", shared=False)
def index(self: IdempotentTask, doc: str) -> str:
    """Index a document once: its words, checkpointed."""
    words = self.step("words", lambda: doc.split("-"))
    return "/".join(words)


@app.task(
    base=IdempotentTask,
    bind=True,
    name="notes.digest",
    idempotency_key="digest:{doc}:v{version}",
    debounce=Debounce(key="digest:{doc}", period=0.2, max_wait=2.0),
    shared=False,
)
def digest(self: IdempotentTask, doc: str, version: int) -> str:
    """Digest the latest version of a document edited in a burst: one run per burst."""
    return f"{doc}@v{version}"
