"""The Celery app of Oncelery's jobs, configured by `celeryconfig` (environment + embedded defaults)."""

from __future__ import annotations

from celery import Celery

app = Celery("oncelery", include=["oncelery.tasks.demo", "oncelery.tasks.articles"])
app.config_from_object("oncelery.celeryconfig")
