"""Sending a delivery back to the broker instead of acking it: whether it can, after a store fault, how soon.

The delivery decides when to re-send (`decision_table.py`); the task supplies how (`IdempotentTask._send_again`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from oncelery.errors import SchemaMissing, StoreError
from oncelery.settings import WAIT_BACKOFF_BASE, WAIT_BACKOFF_CAP

__all__ = [
    "SendAgain",
    "after_store_fault",
    "can_resend",
    "direct_backoff",
    "seconds_until",
    "wait_backoff",
]

# The logger these lines have always been written to: a store fault is part of a delivery's story.
logger = logging.getLogger("oncelery.delivery")


def wait_backoff(waits: int, base: float = WAIT_BACKOFF_BASE, cap: float = WAIT_BACKOFF_CAP) -> float:
    """Return the delay before the `waits`-th re-check of a busy key: exponential, capped, jittered."""
    delay = min(cap, base * (2 ** min(waits, 16)))
    # Full jitter over the top half, so many waiters on one key do not poll in lockstep.
    return float(delay / 2 + random.random() * delay / 2)


def direct_backoff(waits: int) -> float:
    """How long a direct (broker-less) caller sleeps before its `waits`-th look at a live holder's run."""
    return wait_backoff(waits, base=0.02, cap=0.5)


def seconds_until(when: Any) -> float:
    """Celery's retry `when` (a countdown in seconds, or an ETA datetime) as seconds from now, never negative."""
    if isinstance(when, datetime):
        moment = when if when.tzinfo is not None else when.replace(tzinfo=UTC)
        return max(0.0, (moment - datetime.now(UTC)).total_seconds())
    try:
        return max(0.0, float(when or 0))
    except (TypeError, ValueError):
        return 0.0


def can_resend(request: Any, direct: bool) -> bool:
    """Whether a delivery (its Celery request) can be sent again through the broker: not direct, not eager."""
    return not direct and not bool(getattr(request, "is_eager", False))


SendAgain = Callable[..., Any]  # (exc, abandoned=owner or None): re-sends the delivery and raises Retry


def after_store_fault(exc: StoreError, what: str, resend: bool, send_again: SendAgain, owner: str | None = None) -> Any:
    """A store fault: re-send the message (never ack it as a failure); a direct or eager caller gets it.

    `owner`: the claimant this delivery was (or tried to be); its re-send does not count it as lost.
    """
    if not resend:
        raise exc
    log = logger.error if isinstance(exc, SchemaMissing) else logger.warning
    log("claims database failed %s: %s; sending the job again", what, exc)
    return send_again(exc, abandoned=owner)
