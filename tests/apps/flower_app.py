"""The Celery app of the Runs-in-Flower test's Flower (`celery -A tests.apps.flower_app oncelery flower`).

tests/apps/outbox_app.py's app (its broker, backend, claims database and queue from the environment), with
$ONCELERY_TEST_PRICES (JSON) as its `oncelery_prices`: the fork preview prices its steps with them.
"""

from __future__ import annotations

import json
import os

from tests.apps.outbox_app import create_app

app = create_app(os.environ)
app.conf.oncelery_prices = json.loads(os.environ.get("ONCELERY_TEST_PRICES") or "{}")
