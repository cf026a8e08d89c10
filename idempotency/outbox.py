"""The transactional outbox: a job is published if and only if the caller's transaction commits.

    with Session(engine) as session, session.begin():
        session.add(Order(...))
        oncelery.outbox.enqueue(session, charge_card, order_id, amount)   # a row in `outbox`, same txn

The relay (`oncelery relay`, or the beat task of `install_relay_task`) publishes committed rows with the row's
key as the idempotency key, so a re-publish (a relay killed between publishing and marking the row sent) is
absorbed by the claim. The outbox is also the durable record of intent: a SENT row whose run has not
finished after `republish_after` seconds is published again, so a job survives a broker that lost it
(a Redis flush, a failover), which Celery alone does not offer.

This module is the public facade: the rows are written by the outbox's internal module, published by the relay's.
"""

from __future__ import annotations

from oncelery.relay.loop import Relay, RelayRound, install_relay_task
from oncelery.relay.outbox import enqueue

__all__ = ["Relay", "RelayRound", "enqueue", "install_relay_task"]
