"""Defaults and names in one place: environment variables, header names, lease and backoff constants."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Environment variables (the README's configuration table lists every one).
ENV_DATABASE_URL = "ONCELERY_DATABASE_URL"
ENV_BROKER_URL = "ONCELERY_BROKER_URL"
ENV_RESULT_BACKEND = "ONCELERY_RESULT_BACKEND"
ENV_DATA_DIR = "ONCELERY_DATA_DIR"
# The Celery setting an app that does not load celeryconfig.py sets to choose the claims database.
CONF_DATABASE_URL = "oncelery_database_url"

DEFAULT_DATABASE_FILE = "oncelery.db"
DEFAULT_DATA_DIR = ".oncelery"

# Message headers: Celery drops unknown apply_async options but carries custom headers to
# `request.headers` and across `retry()`.
HEADER_KEY = "oncelery_key"
HEADER_WAITS = "oncelery_waits"
HEADER_PIPELINE = "oncelery_pipeline"

MAX_KEY_LENGTH = 255  # the width of task_runs.idempotency_key
DEFAULT_LEASE_SECONDS = 60.0
MIN_LEASE_SECONDS = 0.2
# A holder renews its lease this many times per lease period, so one slow renewal is survivable.
HEARTBEATS_PER_LEASE = 3
# Waiting for a live holder: exponential backoff between these bounds (seconds).
WAIT_BACKOFF_BASE = 0.5
WAIT_BACKOFF_CAP = 10.0
# How long a direct (in-process) call waits for another holder before giving up with InProgress.
DIRECT_WAIT_TIMEOUT = 300.0
SQLITE_BUSY_TIMEOUT_MS = 30_000


def data_dir() -> Path:
    """Return the folder for embedded-default files (SQLite database, broker spool), creating it."""
    path = Path(os.environ.get(ENV_DATA_DIR, DEFAULT_DATA_DIR)).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_database_url() -> str:
    """Return the embedded default database: a SQLite file in the working directory."""
    return f"sqlite:///{Path(DEFAULT_DATABASE_FILE).resolve()}"


@dataclass(frozen=True)
class OnceleryConfig:
    """Typed settings resolved for one Celery app: app config first, then environment, then defaults."""

    database_url: str

    @classmethod
    def from_app_conf(cls, conf: Any) -> OnceleryConfig:
        """Resolve settings from a Celery app's `conf`, falling back to the environment and defaults."""
        url = None
        if conf is not None:
            url = conf.get(CONF_DATABASE_URL)
        url = url or os.environ.get(ENV_DATABASE_URL) or default_database_url()
        return cls(database_url=str(url))
