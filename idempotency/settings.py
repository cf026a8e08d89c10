"""Defaults and names in one place: environment variables, header names, lease and backoff constants."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from oncelery.errors import ConfigurationError
from oncelery.settings_files import env_value

__all__ = [
    "CELERY_DELIVERY_DEFAULTS",
    "CONF_BUDGETS",
    "CONF_BUDGET_RELEASE",
    "CONF_DATABASE_URL",
    "CONF_DIGEST_KEY",
    "CONF_FLOWER_NAME_SUFFIX",
    "CONF_KEEP_ARGUMENTS",
    "CONF_KEPT_ARGUMENTS_RETENTION",
    "CONF_LEASE",
    "CONF_LEDGER_SPOOL_DIR",
    "CONF_LIMITS",
    "CONF_MAX_PAYLOAD_BYTES",
    "CONF_ON_IN_PROGRESS",
    "CONF_PRICES",
    "CONF_PRICE_FILE",
    "CONF_PRODUCER_DEDUPE",
    "CONF_PRODUCER_TIMEOUT",
    "CONF_REPLAY_CACHE",
    "CONF_REPLAY_CACHE_TTL",
    "CONF_STARTUP_WAIT",
    "CONF_STORE_MESSAGE",
    "CONF_TENANT",
    "CONF_WARN_PAYLOAD_BYTES",
    "CONTENT_KEY_PREFIX",
    "DEFAULT_DATABASE_FILE",
    "DEFAULT_DATA_DIR",
    "DEFAULT_KEPT_ARGUMENTS_RETENTION",
    "DEFAULT_LEASE_SECONDS",
    "DEFAULT_LEDGER_SPOOL",
    "DEFAULT_MAX_DELIVERIES",
    "DEFAULT_METRICS_MAX_TENANTS",
    "DEFAULT_PRODUCER_TIMEOUT",
    "DEFAULT_STARTUP_WAIT_SECONDS",
    "DEFAULT_WARN_PAYLOAD_BYTES",
    "DIRECT_WAIT_TIMEOUT",
    "ENV_BROKER_URL",
    "ENV_DATABASE_URL",
    "ENV_DATA_DIR",
    "ENV_DIGEST_KEY",
    "ENV_EXTRA_SECRETS",
    "ENV_HEARTBEAT_FILE",
    "ENV_LEDGER_SPOOL_DIR",
    "ENV_METRICS_MAX_TENANTS",
    "ENV_PASS_THROUGH",
    "ENV_REPLAY_CACHE",
    "ENV_REPLAY_FLUSH_INTERVAL",
    "ENV_RESULT_BACKEND",
    "ENV_SQLITE_BUSY_TIMEOUT",
    "ENV_STARTUP_WAIT",
    "FORK_KEY_PREFIX",
    "HEADER_ABANDONED",
    "HEADER_FORK",
    "HEADER_KEY",
    "HEADER_LEASE",
    "HEADER_ON_IN_PROGRESS",
    "HEADER_PIPELINE",
    "HEADER_PIPELINE_LINK",
    "HEADER_TENANT",
    "HEADER_WAITING_SINCE",
    "HEADER_WAITS",
    "HEARTBEATS_PER_LEASE",
    "IDENTITY_KEY_SECRET",
    "IN_PROGRESS_POLICIES",
    "KNOWN_SETTINGS",
    "LEGACY_CONTENT_KEY_PREFIX",
    "LEGACY_RECHECK_SECONDS",
    "LEGACY_RUNS_SECRET",
    "MAX_KEY_LENGTH",
    "MIN_LEASE_SECONDS",
    "PASS_THROUGH_SEEN",
    "PRODUCER_COOLDOWN",
    "PROVIDER_KEY_SETTINGS",
    "SECRET_SETTINGS",
    "SQLITE_BUSY_TIMEOUT_MS",
    "STARTUP_RETRY_CAP",
    "VISIBILITY_SLACK",
    "WAIT_BACKOFF_BASE",
    "WAIT_BACKOFF_CAP",
    "check_lease",
    "check_policy",
    "check_settings",
    "configured_database_url",
    "data_dir",
    "digest_secret",
    "embedded_database_url",
    "env_seconds",
    "is_embedded_database",
    "pass_through",
    "payload_limits",
    "price_file",
    "require_database_url",
    "sqlite_busy_timeout_ms",
    "startup_wait_seconds",
]

# Environment variables (the README's configuration table lists every one).
ENV_DATABASE_URL = "ONCELERY_DATABASE_URL"
ENV_BROKER_URL = "ONCELERY_BROKER_URL"
ENV_RESULT_BACKEND = "ONCELERY_RESULT_BACKEND"
ENV_DATA_DIR = "ONCELERY_DATA_DIR"
# The Celery setting an app that does not load celeryconfig.py sets to choose the claims database.
CONF_DATABASE_URL = "oncelery_database_url"
# The deployment secret that keys per-field payload digests (so a low-entropy field cannot be brute-forced
# from task_runs); the same on every worker. Unset: no per-field digests are kept (conflicts then cannot
# name the differing fields). Rotating it only makes older runs' conflicts name no fields.
ENV_DIGEST_KEY = "ONCELERY_DIGEST_KEY"
CONF_DIGEST_KEY = "oncelery_digest_key"
# The secret that keys every fingerprint and content-addressed key (HMAC-SHA256): generated in the claims database
# (its oncelery_secrets row) by the first process that needs it, and never rotated, so the same arguments always
# find their run. Beside it, the highest run id when it was generated: runs up to it may hold the forms stored
# before keyed digests and injective key encoding (a legacy lookup finds them; 0: none can).
IDENTITY_KEY_SECRET = "identity_key"
LEGACY_RUNS_SECRET = "legacy_runs_upto"
# How often a process asks again whether runs stored before the upgrade remain (once none does, never again).
LEGACY_RECHECK_SECONDS = 300.0
# A content-addressed key: HMAC-SHA256 of all arguments under the identity key; runs stored before have sha256.
CONTENT_KEY_PREFIX = "hmac-sha256:"
LEGACY_CONTENT_KEY_PREFIX = "sha256:"

# App-wide defaults (app.conf.<name>); a task's own option, then a call's, overrides each.
CONF_LEASE = "oncelery_lease"  # seconds
CONF_ON_IN_PROGRESS = "oncelery_on_in_progress"  # "retry" | "skip" | "raise"
CONF_STORE_MESSAGE = "oncelery_store_message"  # bool
# Keep a run's arguments after it completes (a fork needs them): the task option keep_arguments, else this (False).
# Kept until retention (`oncelery purge`, the relay) clears them, CONF_KEPT_ARGUMENTS_RETENTION after completion.
CONF_KEEP_ARGUMENTS = "oncelery_keep_arguments"
CONF_KEPT_ARGUMENTS_RETENTION = "oncelery_kept_arguments_retention"  # an age: "7d", "24h"
DEFAULT_KEPT_ARGUMENTS_RETENTION = "7d"
# A callable (task_name, args, kwargs) -> tenant or None, called where the job is sent (apply_async) for a
# task with no tenant option of its own; the tenant travels with the message as a header.
CONF_TENANT = "oncelery_tenant"
CONF_PRICES = "oncelery_prices"  # {model: {"input": USD per 1M tokens, "output": USD per 1M tokens}}
# The price table below those overrides (oncelery.ledger.prices): a file in LiteLLM's
# model_prices_and_context_window.json format. Unset: the copy shipped in the wheel; None or False: none (only
# oncelery_prices); a path: that file (e.g. a newer LiteLLM file).
CONF_PRICE_FILE = "oncelery_price_file"
# Shared limits of model calls across the fleet (oncelery.llm.limits): {scope: {"rpm": n, "tpm": n, "burst": n}}
# with scopes "provider:model", "provider:*", "tenant:*" (one limiter per tenant), "tenant:<id>", "task:<name>".
CONF_LIMITS = "oncelery_limits"
# {"global" | "tenant:*" | "tenant:<id>": {"day" | "month": USD}} (docs/limits.md): caps never overspent.
CONF_BUDGETS = "oncelery_budgets"
# Seconds an intent may stay `prepared` with no provider reference and no live holder before the relay releases
# its budget reservation (default 900).
CONF_BUDGET_RELEASE = "oncelery_budget_release_s"
# Where a model call's ledger row waits while the database cannot take it (JSON Lines, one file per process;
# oncelery.ledger.spool): the setting, else the variable, else DEFAULT_LEDGER_SPOOL under the data folder.
# In a container it must be a volume, or a restart loses the spend it holds (docs/operations.md).
CONF_LEDGER_SPOOL_DIR = "oncelery_ledger_spool_dir"
ENV_LEDGER_SPOOL_DIR = "ONCELERY_LEDGER_SPOOL_DIR"
DEFAULT_LEDGER_SPOOL = "ledger-spool"
# The replay cache (oncelery.delivery.replay_cache): a Redis URL; duplicates of finished runs are answered there.
CONF_REPLAY_CACHE = "oncelery_replay_cache"
ENV_REPLAY_CACHE = "ONCELERY_REPLAY_CACHE"
CONF_REPLAY_CACHE_TTL = "oncelery_replay_cache_ttl"  # seconds an entry lives (default 600)
ENV_REPLAY_FLUSH_INTERVAL = "ONCELERY_REPLAY_FLUSH_INTERVAL"  # seconds between writes of cached replays' counts
# A call's payload (its args and kwargs as the JSON it sends), measured at apply_async: above the first (bytes;
# 0 or None: off) a warning suggests passing a reference; above the second (default: off) the call is refused.
CONF_WARN_PAYLOAD_BYTES = "oncelery_warn_payload_bytes"
CONF_MAX_PAYLOAD_BYTES = "oncelery_max_payload_bytes"
DEFAULT_WARN_PAYLOAD_BYTES = 1 << 20  # 1 MiB: a broker message that size is a database row or an object's id
# How long a starting worker waits for a claims database that does not answer yet (then refuses); 0: refuse at
# once. A setting and a variable: `celery worker` takes no option of ours.
CONF_STARTUP_WAIT = "oncelery_startup_wait_s"
ENV_STARTUP_WAIT = "ONCELERY_STARTUP_WAIT_S"
DEFAULT_STARTUP_WAIT_SECONDS = 60.0  # longer than a PostgreSQL container's start, shorter than a pager's patience
STARTUP_RETRY_CAP = 5.0  # seconds: the longest pause between two attempts of that wait
# A Redis visibility timeout above this many times the tasks' longest hold (max_lease + lease) is reported at
# worker start: a killed worker's job would wait that long to run again.
VISIBILITY_SLACK = 4
# True: task events also rename the task for Flower ("shop.charge [replayed]"). Off by default: every monitor
# that labels by task name (Flower's /metrics, celery-exporter) would count steps x outcomes names per task.
CONF_FLOWER_NAME_SUFFIX = "oncelery_flower_name_suffix"  # bool, default False
# Producer dedupe (oncelery.basetask.producer): where the producer has a claims database configured, `.delay()` of an
# idempotent task asks it first and answers a duplicate of a finished run without publishing. A bool (default
# True); a task's `producer_dedupe=` option and a call's override it. The timeout (seconds, default 0.25) bounds
# the check; past it, or on any database error, the call publishes as it would without the check (fails open).
CONF_PRODUCER_DEDUPE = "oncelery_producer_dedupe"
CONF_PRODUCER_TIMEOUT = "oncelery_producer_timeout"
DEFAULT_PRODUCER_TIMEOUT = 0.25
# After a failed check, a producer publishes without asking for this long (seconds): a database that is down
# must not add a timeout to every call.
PRODUCER_COOLDOWN = 5.0
# OpenTelemetry traces and metrics (the oncelery[otel] extra; oncelery.tracing.otel): off unless app.conf.oncelery_otel
# is true, else $ONCELERY_OTEL is 1. Spans and points go to the process's global OpenTelemetry providers.
CONF_OTEL = "oncelery_otel"
ENV_OTEL = "ONCELERY_OTEL"
# Every app.conf.oncelery_* setting there is: any other name is a typo, refused with its name.
KNOWN_SETTINGS = frozenset(
    {
        CONF_DATABASE_URL,
        CONF_DIGEST_KEY,
        CONF_FLOWER_NAME_SUFFIX,
        CONF_LEASE,
        CONF_ON_IN_PROGRESS,
        CONF_STORE_MESSAGE,
        CONF_TENANT,
        CONF_PRICES,
        CONF_PRICE_FILE,
        CONF_LIMITS,
        CONF_BUDGETS,
        CONF_BUDGET_RELEASE,
        CONF_LEDGER_SPOOL_DIR,
        CONF_REPLAY_CACHE,
        CONF_REPLAY_CACHE_TTL,
        CONF_WARN_PAYLOAD_BYTES,
        CONF_MAX_PAYLOAD_BYTES,
        CONF_STARTUP_WAIT,
        CONF_PRODUCER_DEDUPE,
        CONF_PRODUCER_TIMEOUT,
        CONF_OTEL,
    }
)
# The pass-through switch for plain unit tests (as Powertools' POWERTOOLS_IDEMPOTENCY_DISABLED): the body runs
# with no claim, no lease and no stored result. Loud on purpose: a worker logs a warning at start and records
# it in the claims database, where `oncelery runs list` shows it.
ENV_PASS_THROUGH = "ONCELERY_PASS_THROUGH"
PASS_THROUGH_SEEN = "pass_through_seen"  # its oncelery_secrets row: when and where a worker last ran with it

DEFAULT_DATABASE_FILE = "oncelery.db"
DEFAULT_DATA_DIR = ".oncelery"

# Message headers: Celery drops unknown apply_async options but carries custom headers to
# `request.headers` and across `retry()`.
HEADER_KEY = "oncelery_key"
HEADER_TENANT = "oncelery_tenant"
HEADER_WAITS = "oncelery_waits"
# When (database clock, seconds since 1970) a message first found its key held by a live holder: its re-checks
# count no more `in_progress`, and the delivery that stops waiting observes the wait (oncelery.runs.waits).
HEADER_WAITING_SINCE = "oncelery_waiting_since"
# The owner a delivery claimed (or tried to) before a database fault made it send the job again: that holder
# did not vanish, so its run taken over by this message is not a lost delivery (no step towards max_deliveries).
HEADER_ABANDONED = "oncelery_abandoned"
# Set by the relay's waker on the message that wakes a parked (WAITING) run: its re-attached model call is polled
# once, then the run parks again, instead of holding the slot for another inline wait.
HEADER_WOKEN = "oncelery_woken"
HEADER_PIPELINE = "oncelery_pipeline"
# A pipeline link keyed by its own task (basetask/pipeline.py): its position, so a worker finds the run the code before
# stored under the pipeline-derived key (runs/legacy.py).
HEADER_PIPELINE_LINK = "oncelery_pipeline_link"
# Per-call options (apply_async(..., on_in_progress=..., lease=...)), carried to every delivery of the call.
HEADER_ON_IN_PROGRESS = "oncelery_on_in_progress"
HEADER_LEASE = "oncelery_lease"
# A fork's run (ops/fork.py): its key is FORK_KEY_PREFIX + "<fork id>:" + the source run's key, so it never takes
# production's claim; the header carries the fork's id to the worker (the key alone also names it).
FORK_KEY_PREFIX = "fork:"
HEADER_FORK = "oncelery_fork"
# A debounced burst's message (relay/debounce.py): its debounce key and the sequence of the edit it carries; a
# delivery whose sequence is older than its row's is acked as `debounced`.
HEADER_DEBOUNCE_KEY = "oncelery_debounce_key"
HEADER_DEBOUNCE_SEQ = "oncelery_debounce_seq"
IN_PROGRESS_POLICIES = ("retry", "skip", "raise")

MAX_KEY_LENGTH = 255  # the width of task_runs.idempotency_key
DEFAULT_LEASE_SECONDS = 60.0
MIN_LEASE_SECONDS = 0.2
# Deliveries lost with their worker (SIGKILL, OOM, segfault) before a run is dead-lettered as poison.
DEFAULT_MAX_DELIVERIES = 5
# A holder renews its lease this many times per lease period, so one slow renewal is survivable.
HEARTBEATS_PER_LEASE = 3
# Waiting for a live holder: exponential backoff between these bounds (seconds).
WAIT_BACKOFF_BASE = 0.5
WAIT_BACKOFF_CAP = 10.0
# How long a direct (in-process) call waits for another holder before giving up with InProgress.
DIRECT_WAIT_TIMEOUT = 300.0
SQLITE_BUSY_TIMEOUT_MS = 30_000
# How long a SQLite statement waits for the write lock before it fails (and the job is sent again).
ENV_SQLITE_BUSY_TIMEOUT = "ONCELERY_SQLITE_BUSY_TIMEOUT"
# A file the worker (on each Celery heartbeat) and the relay (after each round) touch: its age is their health
# check (deploy/bin/oncelery-healthcheck). Unset: no file.
ENV_HEARTBEAT_FILE = "ONCELERY_HEARTBEAT_FILE"
# `oncelery metrics`: tenants that keep their own `tenant` label (the most active); the rest are summed as
# "other", so a SaaS with 50,000 customers does not become 50,000 series per metric (docs/metrics.md).
ENV_METRICS_MAX_TENANTS = "ONCELERY_METRICS_MAX_TENANTS"
DEFAULT_METRICS_MAX_TENANTS = 20
# The settings that may hold a secret: each is also read from the file VAR_FILE names (oncelery.settings_files).
SECRET_SETTINGS = (ENV_DATABASE_URL, ENV_BROKER_URL, ENV_RESULT_BACKEND, ENV_DIGEST_KEY, ENV_REPLAY_CACHE)
# The model providers' keys, as Oncelery's adapters and the providers' own SDKs name them. Those read only VAR, so
# the deploy scripts' start guard (oncelery.cli.service_env) reads each from VAR_FILE too and exports it as VAR,
# and refuses a placeholder: a key mounted as a secret reaches a worker's and the relay's model calls.
PROVIDER_KEY_SETTINGS = (
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "AZURE_OPENAI_API_KEY",
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
)
# More variables the start guard treats as those keys (names separated by spaces or commas): an app's own secrets
# (another provider's key, a vector store's token), so they too can come from VAR_FILE.
ENV_EXTRA_SECRETS = "ONCELERY_EXTRA_SECRETS"


def env_seconds(name: str, default: float, *, zero_ok: bool = False) -> float:
    """Seconds from environment variable `name` (else `default`), or ConfigurationError naming it and what to give."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0  # reported below, with what to give, instead of float()'s traceback
    if not (value >= 0 if zero_ok else value > 0):  # also refuses nan
        what = ">= 0" if zero_ok else "as a number > 0"
        raise ConfigurationError(f"{name}={raw!r}: give seconds {what} (e.g. {default:g})")
    return value


def sqlite_busy_timeout_ms() -> int:
    """SQLite's busy timeout in ms: $ONCELERY_SQLITE_BUSY_TIMEOUT (seconds) if set, else 30 s; read per engine."""
    return int(env_seconds(ENV_SQLITE_BUSY_TIMEOUT, SQLITE_BUSY_TIMEOUT_MS / 1000, zero_ok=True) * 1000)


# Celery's delivery settings Oncelery is deployed with, written once: celeryconfig.py, the tests and the
# benchmarks read them from here. Late acks + reject on worker lost give at-least-once delivery, which the
# claim turns into exactly-once effects; prefetch 1 keeps a crashed worker from holding extra messages;
# JSON only, never pickle. No Redis visibility_timeout: it follows from the tasks' leases, which a static dict
# cannot know, so a starting worker derives it where the app sets none (oncelery.basetask.visibility).
CELERY_DELIVERY_DEFAULTS: dict[str, Any] = {
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "worker_prefetch_multiplier": 1,
    "task_serializer": "json",
    "result_serializer": "json",
    "accept_content": ["json"],
    "result_accept_content": ["json"],
}


def data_dir() -> Path:
    """Return the folder for embedded-default files (SQLite database, broker spool), creating it."""
    path = Path(os.environ.get(ENV_DATA_DIR, DEFAULT_DATA_DIR)).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def embedded_database_url() -> str:
    """The embedded default database of the demo commands and examples: a SQLite file in the working folder."""
    return f"sqlite:///{Path(DEFAULT_DATABASE_FILE).resolve()}"


def is_embedded_database(url: str) -> bool:
    """Whether `url` is the demo's embedded database: a SQLite file that is ./oncelery.db of the working folder.

    Compared by resolved path, whichever setting named it (the demo's default, --database-url, the environment):
    the database the demo commands and `celery -A oncelery.tasks.app worker` use when run from this folder.
    """
    try:
        parsed = make_url(url)
    except ArgumentError:
        return False
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return False
    return Path(str(parsed.database)).resolve() == Path(DEFAULT_DATABASE_FILE).resolve()


def configured_database_url(conf: Any = None) -> str | None:
    """Return the app's `oncelery_database_url`, else $ONCELERY_DATABASE_URL(_FILE), else None (never a default)."""
    url = conf.get(CONF_DATABASE_URL) if conf is not None else None
    return str(url or env_value(ENV_DATABASE_URL) or "") or None


def digest_secret(conf: Any = None) -> bytes | None:
    """Return the secret that keys per-field digests (app config, else $ONCELERY_DIGEST_KEY(_FILE)), or None."""
    value = (conf.get(CONF_DIGEST_KEY) if conf is not None else None) or env_value(ENV_DIGEST_KEY)
    return str(value).encode("utf-8") if value else None


def require_database_url(conf: Any = None, who: str = "This worker") -> str:
    """Return the configured claims database, or raise ConfigurationError saying what to set."""
    url = configured_database_url(conf)
    if url is None:
        raise ConfigurationError(
            f"{who} has no claims database: set {ENV_DATABASE_URL} (e.g. postgresql://user@host/db) or "
            f"app.conf.{CONF_DATABASE_URL}; every worker must share one database, so there is no default"
        )
    return url


def check_settings(conf: Any) -> None:
    """Raise ConfigurationError naming any app.conf.oncelery_* setting Oncelery does not know (a typo)."""
    unknown = sorted(
        name for name in conf if name.lower().startswith("oncelery_") and name.lower() not in KNOWN_SETTINGS
    )
    if unknown:
        raise ConfigurationError(
            f"unknown Oncelery setting(s) {', '.join(unknown)} in the Celery app's configuration; the known ones "
            f"are {', '.join(sorted(KNOWN_SETTINGS))}: fix the name, or remove it"
        )


def check_policy(value: Any, who: str) -> str:
    """Return an on_in_progress policy, or raise ConfigurationError naming the choices."""
    if value not in IN_PROGRESS_POLICIES:
        raise ConfigurationError(f"{who}: on_in_progress={value!r}; choose one of {IN_PROGRESS_POLICIES}")
    return str(value)


def check_lease(value: Any, who: str) -> float:
    """Return a lease in seconds, or raise ConfigurationError saying what a lease must be."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < MIN_LEASE_SECONDS:
        raise ConfigurationError(f"{who}: lease={value!r}; give seconds >= {MIN_LEASE_SECONDS}")
    return float(value)


def startup_wait_seconds(conf: Any = None) -> float:
    """How long a starting worker waits for its claims database: app.conf.oncelery_startup_wait_s, else
    $ONCELERY_STARTUP_WAIT_S, else 60 s; a bad value raises ConfigurationError naming the setting."""
    value = conf.get(CONF_STARTUP_WAIT) if conf is not None else None
    if value is None:
        return env_seconds(ENV_STARTUP_WAIT, DEFAULT_STARTUP_WAIT_SECONDS, zero_ok=True)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigurationError(f"app.conf.{CONF_STARTUP_WAIT}={value!r}: give seconds >= 0 (0: do not wait)")
    return float(value)


def payload_limits(conf: Any) -> tuple[int | None, int | None]:
    """The (warn, max) payload sizes in bytes of app.conf.oncelery_warn/max_payload_bytes (None: off); a bad
    value raises ConfigurationError naming the setting."""
    warn = _bytes_setting(conf, CONF_WARN_PAYLOAD_BYTES, DEFAULT_WARN_PAYLOAD_BYTES)
    return warn, _bytes_setting(conf, CONF_MAX_PAYLOAD_BYTES, None)


def _bytes_setting(conf: Any, name: str, default: int | None) -> int | None:
    value = conf.get(name, default)
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"app.conf.{name}={value!r}: give bytes as an int (e.g. {1 << 20}), or 0 for off")
    return value


def price_file(conf: Any, shipped: Path) -> Path | None:
    """The price file app.conf.oncelery_price_file names: `shipped` when unset, None when None or False (off), else
    that path; any other value raises ConfigurationError saying what to give."""
    value = shipped if conf is None else conf.get(CONF_PRICE_FILE, shipped)
    if value is None or value is False:
        return None
    if isinstance(value, str | os.PathLike) and str(os.fspath(value)).strip():
        return Path(os.fspath(value)).expanduser()
    raise ConfigurationError(
        f"app.conf.{CONF_PRICE_FILE}={value!r}: give the path of a price file in LiteLLM's "
        f"model_prices_and_context_window.json format, None to price from app.conf.{CONF_PRICES} alone, or leave it "
        f"unset for the table shipped with Oncelery"
    )


def pass_through() -> bool:
    """Whether $ONCELERY_PASS_THROUGH switches the claim off (for plain unit tests only)."""
    raw = os.environ.get(ENV_PASS_THROUGH, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigurationError(f"{ENV_PASS_THROUGH}={raw!r}: give 1 (claims off, unit tests only) or 0")
