"""The broker's visibility timeout against the tasks' leases, settled when a worker starts.

On Redis (redis://, rediss://, sentinel://) an unacked message goes back to its queue once it has been out
`visibility_timeout` seconds (kombu's default: 3600). With late acks that is how a killed worker's job runs
again, so the timeout is a recovery delay; and a job still running past it is delivered to a second worker
(the claim makes that copy wait: harmless, but a wasted delivery). The right value follows from the tasks:

    hold(task) = max_lease + lease   the longest a live holder keeps its claim: renewals stop after max_lease,
                                     and the last one expires one lease later (by the database clock)
    derived    = max(hold) over the worker's idempotent tasks, rounded up to whole seconds

Where the app sets no visibility_timeout, the worker merges the derived one into its broker_transport_options
(the app's other options, such as Sentinel's master_name or priority_steps, are kept) before its consumer
connects: Celery builds the consumer's kombu Connection from app.conf.broker_transport_options after
worker_init, kombu's Redis Channel copies `visibility_timeout` from the transport options, and its QoS restores
the unacked messages older than that. A task with no bound (no max_lease, no time limit) has no hold to derive
from: the timeout is left as it is, with one warning naming the task.

Where the app sets one, it is kept, with one warning line when it is far from the holds (a task with no bound
counting its lease as its hold):

    visibility < longest hold                     a running job is redelivered to a second worker mid-run
    visibility > VISIBILITY_SLACK x longest hold  a killed worker's job waits that long to run again

Other transports are left alone: RabbitMQ has no visibility timeout (its consumer_timeout is another matter,
docs/operations.md), and the embedded filesystem broker deletes a message when a worker takes it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kombu.transport import resolve_transport

from oncelery.settings import VISIBILITY_SLACK

__all__ = [
    "VISIBILITY_OPTION",
    "Hold",
    "hold_of",
    "settle_visibility",
]

logger = logging.getLogger("oncelery.startup")  # the startup check's lines, under its stable name

VISIBILITY_OPTION = "visibility_timeout"
_REDIS_DRIVER = "redis"  # kombu's driver_type of its Redis and Sentinel transports


@dataclass(frozen=True)
class Hold:
    """How long a task's live holder may keep its claim (max_lease + lease), or only its lease if unbounded."""

    task: str
    seconds: float
    bounded: bool

    def described(self) -> str:
        """The hold in a few words, for a log line: '62 s (t: max_lease+lease)'."""
        how = "max_lease+lease" if self.bounded else "lease, no max_lease"
        return f"{self.seconds:g} s ({self.task}: {how})"


def hold_of(task: Any) -> Hold:
    """The hold of an IdempotentTask: its renewal bound (max_lease, else a time limit) plus its lease."""
    lease = task.lease_for()
    bound = task.max_lease_seconds()
    if bound is None:
        return Hold(task.name, lease, bounded=False)
    return Hold(task.name, bound + lease, bounded=True)


def settle_visibility(app: Any, tasks: Iterable[Any]) -> float | None:
    """Give a Redis broker the visibility timeout the tasks need where the app sets none; warn where the app's
    is far from their holds. Return the timeout the worker's consumer will use, or None if it is not ours to know.
    """
    holds = [hold_of(task) for task in tasks]
    channel = _redis_channel(app)
    if channel is None or not holds:
        return None
    longest = max(holds, key=lambda hold: hold.seconds)
    options = dict(app.conf.broker_transport_options or {})
    if VISIBILITY_OPTION in options:
        try:
            seconds = float(options[VISIBILITY_OPTION])
        except (TypeError, ValueError):
            return None  # kombu's to judge: not a number we can compare
        _report(seconds, longest)
        return seconds
    unbounded = next((hold for hold in holds if not hold.bounded), None)
    if unbounded is not None:
        kept = float(channel.visibility_timeout)
        logger.warning(
            "oncelery: %s has no max_lease (nor time_limit): visibility_timeout stays %g s, a killed worker's job "
            "waits that long; set max_lease, or broker_transport_options['visibility_timeout']",
            unbounded.task,
            kept,
        )
        return kept
    seconds = float(math.ceil(longest.seconds))
    # A new dict, merged: the app's own dict may be shared (a module constant), and its other options stay.
    app.conf.broker_transport_options = {**options, VISIBILITY_OPTION: seconds}
    logger.info("oncelery: visibility_timeout=%g s, derived from the longest hold %s", seconds, longest.described())
    return seconds


def _report(visibility: float, longest: Hold) -> None:
    if visibility < longest.seconds:
        logger.warning(
            "oncelery: visibility_timeout=%g s < hold %s: a running job is redelivered mid-run (absorbed, wasted)",
            visibility,
            longest.described(),
        )
    elif visibility > VISIBILITY_SLACK * longest.seconds:
        logger.warning(
            "oncelery: visibility_timeout=%g s > %dx hold %s: a killed worker's job waits %g s to run again",
            visibility,
            VISIBILITY_SLACK,
            longest.described(),
            visibility,
        )


def _redis_channel(app: Any) -> Any:
    # The transport class from the broker URL, without connecting (a kombu Connection is lazy).
    conn = app.connection_for_read()
    try:
        transport = resolve_transport(conn.transport_cls)
    except (ImportError, KeyError, ValueError):
        return None  # a transport kombu cannot load: the consumer reports that itself
    finally:
        conn.release()
    if getattr(transport, "driver_type", None) != _REDIS_DRIVER:
        return None
    return getattr(transport, "Channel", None)
