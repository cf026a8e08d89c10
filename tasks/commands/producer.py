"""What the `demo` and `process` commands share as producers: a delivery plan, run polling, a local worker."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from oncelery import ENV_DATABASE_URL, data_dir, upgrade_schema
from oncelery.models.migrate import JOBS
from oncelery.tasks.commands.local_worker import LocalWorker

# The app the `process` command's worker runs, and the variable through which it passes --lease to it.
WORKER_APP = "oncelery.tasks.worker_app"
ENV_LEASE = "ONCELERY_PROCESS_LEASE"


def plan_deliveries(count: int, duplicates: float, seed: str = "oncelery-demo-plan") -> list[int]:
    """Return the indices to send, in order: each once, plus a second copy of round(count * duplicates).

    Half of the copies follow their first copy at once (a double submit: a second worker process takes it
    while the first still runs, so it waits as in_progress); half come later (a redelivery: it finds the
    stored result). The same plan on every run and machine.
    """
    rng = random.Random(f"{seed}:{count}:{duplicates}")
    slots = [(float(i), i) for i in range(count)]
    for n, i in enumerate(rng.sample(range(count), round(count * duplicates))):
        slots.append((i + 0.5 if n % 2 == 0 else rng.uniform(i + 0.5, count), i))
    return [i for _, i in sorted(slots)]


def prepare_database(url: str) -> list[str]:
    """Create or migrate the framework's tables and the demo jobs' own (their branch), saying what was done."""
    return [upgrade_schema(url), upgrade_schema(url, JOBS)]


def start_local_worker(
    database_url: str,
    log_name: str,
    concurrency: int,
    queue: str | None = None,
    app: str = "oncelery.tasks.app",
    extra_env: Mapping[str, str] | None = None,
) -> LocalWorker:
    """Start `celery -A <app> worker` on `database_url` (the one this command resolved and migrated)."""
    env = {**os.environ, **(extra_env or {}), ENV_DATABASE_URL: database_url}
    return LocalWorker(
        app,
        log_path(log_name),
        concurrency=concurrency,
        env=env,
        queues=[queue] if queue else None,
    ).start()


def log_path(name: str) -> Path:
    """Return the path of a log file under the data folder (./.oncelery)."""
    return data_dir() / name


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block a SIGTERM raises KeyboardInterrupt, so `finally` clauses stop the command's worker."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt
