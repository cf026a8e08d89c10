"""A user's own Celery app, as it would be written outside this project: it imports only `oncelery`.

Configured from the environment (the tests set it; a subprocess worker inherits it):
SHOP_BROKER_URL, SHOP_RESULT_BACKEND (Redis), SHOP_QUEUE (a queue of its own per test run),
SHOP_VISIBILITY_TIMEOUT (seconds before Redis re-delivers an unacked job), and ONCELERY_DATABASE_URL.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from celery import Celery
from sqlalchemy import Column, Integer, MetaData, String, Table, insert

from oncelery import CELERY_DELIVERY_DEFAULTS, IdempotentTask, model_call

metadata = MetaData()
#: The shop's own table: one row per charge, written through effects() so it commits with the run.
charges = Table(
    "shop_charges",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("order_id", String(64), nullable=False),
    Column("amount", Integer, nullable=False),
    Column("risk", String(16), nullable=False),
)

app = Celery(
    "shop",
    broker=os.environ.get("SHOP_BROKER_URL", "redis://127.0.0.1:6379/0"),
    backend=os.environ.get("SHOP_RESULT_BACKEND", "redis://127.0.0.1:6379/0"),
)
app.conf.update(CELERY_DELIVERY_DEFAULTS)
app.conf.task_default_queue = os.environ.get("SHOP_QUEUE", "shop")
_queue = app.conf.task_default_queue
app.conf.broker_transport_options = {
    "visibility_timeout": float(os.environ.get("SHOP_VISIBILITY_TIMEOUT", "3600")),
    "unacked_restore_interval": 1,  # look for expired unacked jobs every second (a test wants them soon)
    "unacked_restore_throttle": 1,
    # Bookkeeping of its own: a short visibility timeout must never restore another app's in-flight jobs.
    "unacked_key": f"{_queue}.unacked",
    "unacked_index_key": f"{_queue}.unacked_index",
    "unacked_mutex_key": f"{_queue}.unacked_mutex",
}
app.conf.worker_hijack_root_logger = False
app.conf.oncelery_lease = 3.0  # app-wide: a vanished holder's run is taken over within seconds


def _hold(order_id: str) -> None:
    """Hold the body while the test's flag file exists (a long model call, without a fixed sleep)."""
    flag = Path(os.environ.get("SHOP_HOLD_DIR", "/nonexistent")) / order_id
    while flag.exists():
        time.sleep(0.05)


def fetch(order_id: str) -> dict[str, object]:
    """Step 1: load the order (here: derived from its id)."""
    return {"order_id": order_id, "items": len(order_id)}


def score(order: dict[str, object]) -> str:
    """Step 2: the model's risk verdict (here: a rule), recorded in the cost ledger as a model call."""
    with model_call("risk-rules-v1", prompt="risk") as call:
        verdict = "low" if int(str(order["items"])) < 10 else "high"
        call.tokens(int(str(order["items"])), 1)
    return verdict


@app.task(base=IdempotentTask, bind=True, name="shop.charge", idempotency_key="charge:{order_id}", shared=False)
def charge(self: IdempotentTask, order_id: str, amount: int) -> dict[str, object]:
    """Charge an order once: fetch, score (checkpointed steps), then write the charge with the run."""
    order = self.step("fetch", fetch, order_id)
    _hold(order_id)
    risk = self.step("score", score, order)
    with self.effects() as session:
        session.execute(insert(charges).values(order_id=order_id, amount=amount, risk=risk))
    return {"order_id": order_id, "amount": amount, "risk": risk}
