"""The Celery app of Oncelery's demo jobs: `celery -A oncelery.tasks.app worker`.

Configured by `oncelery.celeryconfig` (environment variables). This is the demo: with no claims database
configured it uses the embedded SQLite file ./oncelery.db, and says so in the worker's log. A worker of
any other app must be given a database (ONCELERY_DATABASE_URL or app.conf.oncelery_database_url).
"""

from __future__ import annotations

import logging

from celery import Celery

from oncelery import configured_database_url, embedded_database_url

app = Celery("oncelery", include=["oncelery.tasks.demo", "oncelery.tasks.articles"])
app.config_from_object("oncelery.celeryconfig")
if configured_database_url(app.conf) is None:
    app.conf.oncelery_database_url = embedded_database_url()
    logging.getLogger(__name__).info(
        "demo app: no ONCELERY_DATABASE_URL, using the embedded database %s", app.conf.oncelery_database_url
    )
