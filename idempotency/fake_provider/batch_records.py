"""What the fake's batch APIs keep: stored files, batches and their items, and the helpers their lists share.

The records are plain data: `files` stores files, `batch_checks` turns a create into a `Plan`, `batches` moves
a `Batch` and `batch_shapes` draws it as each provider's wire object. The providers' shapes are in `batches`.
"""

from __future__ import annotations

import json
import random
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

DAY_S = 86400
OPENAI_ENDED = frozenset({"completed", "failed", "expired", "cancelled"})
GEMINI_ENDED = frozenset(
    {"BATCH_STATE_SUCCEEDED", "BATCH_STATE_FAILED", "BATCH_STATE_CANCELLED", "BATCH_STATE_EXPIRED"}
)
_T = TypeVar("_T")


class BatchError(Exception):
    """A batch or file request the provider refuses: the HTTP status and the message its error envelope carries."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class StoredFile:
    """An uploaded file (purpose `batch`...) or a batch's output or error file (purpose `batch_output`)."""

    id: str
    filename: str
    purpose: str
    content: bytes
    created_at: int
    seq: int

    def as_json(self) -> dict[str, Any]:
        """Return OpenAI's File object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": len(self.content),
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


@dataclass
class Item:
    """One request of a batch and, once done, its outcome."""

    position: int
    custom_id: str
    body: dict[str, Any]
    fail: bool = False  # an injected failure (batch_fail_ids, batch_fail_first), decided at the create
    outcome: str | None = None  # succeeded, errored, expired or canceled; None while not done
    status_code: int = 200
    response: dict[str, Any] | None = None  # the answer's JSON, or the error envelope when errored
    line_id: str = field(default_factory=lambda: "batch_req_" + uuid.uuid4().hex)
    request_id: str = field(default_factory=lambda: "req_" + uuid.uuid4().hex)


@dataclass
class Batch:
    """A batch of any provider: its requests, where it is, and its knobs as they were at its create."""

    id: str
    provider: str  # "openai" | "anthropic" | "gemini"
    kind: str  # the synchronous kind of its requests: responses, chat, messages or gemini
    items: list[Item]
    created_at: float  # epoch seconds
    seq: int  # creation order (newest first in lists)
    polls: int
    expire: bool
    shuffle: bool
    endpoint: str = ""
    input_file_id: str = ""
    metadata: dict[str, str] | None = None
    model: str = ""  # Gemini: the model its requests run on (the batch's path names it)
    display_name: str = ""  # Gemini: the batch's displayName
    status: str = "validating"
    retrieves: int = 0
    times: dict[str, float] = field(default_factory=dict)  # status (or event) -> epoch seconds it was reached
    output_file_id: str | None = None
    error_file_id: str | None = None
    hold: int | None = None  # held (`batch_hold`): in progress until the state's release count passes this
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def ended(self) -> bool:
        """Whether the batch has ended (nothing in it moves any more)."""
        return self.status in OPENAI_ENDED or self.status == "ended" or self.status in GEMINI_ENDED


@dataclass
class Plan:
    """A validated create, not yet accepted: what the batch will be made of."""

    provider: str
    kind: str
    lines: list[tuple[str, dict[str, Any]]]
    endpoint: str = ""
    input_file_id: str = ""
    metadata: dict[str, str] | None = None
    model: str = ""
    display_name: str = ""


def output_order(batch: Batch) -> list[int]:
    """The positions in the order the results come out: input order, or shuffled (never as input) with the knob."""
    order = list(range(len(batch.items)))
    if batch.shuffle and len(order) > 1:
        random.Random(batch.id).shuffle(order)
        if order == sorted(order):
            order.reverse()
    return order


def jsonl(lines: Iterable[dict[str, Any]]) -> bytes:
    """Return the lines as JSON Lines, each ended by a newline."""
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def rfc3339(epoch: float) -> str:
    """Return an epoch time as RFC 3339 in UTC with microseconds and a `Z`, as Anthropic and Google write it."""
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


# -- lists: query arguments and pages ------------------------------------------------------------------------------
def query_arg(query: dict[str, list[str]], name: str) -> str | None:
    """Return the first value of a query argument, or None when it is absent."""
    values = query.get(name)
    return values[0] if values else None


def query_limit(query: dict[str, list[str]], name: str, default: int, most: int) -> int:
    """Return a page size argument (`default` when absent); refuse with 400 one not from 1 to `most`."""
    text = query_arg(query, name)
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise BatchError(400, f"Invalid '{name}': expected an integer from 1 to {most}.")
    return int(text)


def paginate(
    rows: list[_T], key: Callable[[_T], str], after: str | None, before: str | None, limit: int
) -> tuple[list[_T], bool]:
    """One page of `rows` (already in list order) after or before a cursor id; an unknown cursor gives no rows."""
    ids = [key(r) for r in rows]
    if before is not None:
        if before not in ids:
            return [], False
        upto = ids.index(before)
        start = max(0, upto - limit)
        return rows[start:upto], start > 0
    start = 0
    if after is not None:
        if after not in ids:
            return [], False
        start = ids.index(after) + 1
    return rows[start : start + limit], start + limit < len(rows)


def list_page(data: list[dict[str, Any]], more: bool, openai: bool) -> dict[str, Any]:
    """Return a page as OpenAI's list object (`object: "list"`) or Anthropic's (the same without `object`)."""
    page = {
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }
    return {"object": "list", **page} if openai else page
