"""The kit isolates an app for a test: the test process (the producer) and the kit's workers use the test's claims
database, queues of the test's own namespace, and results under that namespace; then the app is as it was.

Why the producer too: a developer's worker may run beside the tests on the app's own configuration. Were only the
workers moved, a `.delay()` of the test would be answered from the developer's database (producer dedupe), a
debounced one would write its row there, and the developer's worker, consuming the app's queue, would take the
test's jobs and run them on that database.

What the kit sets, for a block of the test process, or for the life of a kit worker subprocess:

    oncelery_database_url          the test database ($ONCELERY_DATABASE_URL too, for code outside tasks)
    task_default_queue,            prefixed by the namespace, `oncelery-test-<digest of the test database URL>.`,
    task_queues, the default       so the workers consume the test's queues only
    exchange and routing key
    routing                        every destination a route (task_routes), a task or a call names: its queue,
                                   exchange and routing key get the prefix too, so the app's routes lead to
                                   the test's queues
    result backend                 a key-value one (Redis, ...): its keys under the prefix (the transport
                                   option global_keyprefix); `db+...`: the test database; rpc:// and none: as
                                   they are (nothing shared); any other: as the app sets it

The namespace is a digest of the test database's URL: every helper of one test, a worker subprocess included,
derives the same one without being told, and no two tests share one (each has a database of its own). Entered
again for the same app and database (a worker inside the test's fixture), isolation is shared, not stacked.
On Redis, leaving it deletes the test's queues, bindings and bookkeeping keys (results expire as the app's do).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from celery.app.backends import by_url
from celery.app.routes import Router
from celery.backends.base import BaseKeyValueStoreBackend
from celery.backends.database import DatabaseBackend
from kombu.entity import Exchange, Queue, binding
from sqlalchemy.engine import make_url

from oncelery.errors import ConfigurationError
from oncelery.settings import CONF_DATABASE_URL, ENV_DATABASE_URL
from oncelery.settings_files import FILE_SUFFIX
from oncelery.testing.broker import drop_queues, on_redis

__all__ = ["NAMESPACE_PREFIX", "Isolation", "Namespace", "isolate", "isolated", "namespace_of"]

logger = logging.getLogger("oncelery.testing")

#: How every namespace of the kit begins (a test's queues are `oncelery-test-<digest>.<the app's name>`).
NAMESPACE_PREFIX = "oncelery-test-"
_ROUTING = ("task_default_queue", "task_default_exchange", "task_default_routing_key", "task_queues")
_RESULTS = ("result_backend", "result_backend_transport_options")
# The amqp attributes Celery computes once from the settings above (at the app's first send, or a worker's start).
_AMQP_CACHED = ("queues", "default_queue", "default_exchange", "router", "send_task_message")


def namespace_of(url: str) -> str:
    """The namespace of the test whose claims database is `url` (the same in every process of the test)."""
    return NAMESPACE_PREFIX + hashlib.blake2b(url.encode(), digest_size=5).hexdigest()


@dataclass(frozen=True)
class Namespace:
    """Names prefixed by `<namespace>.`: a queue, exchange or routing key of the app becomes the test's own."""

    name: str

    @property
    def prefix(self) -> str:
        """What every name in the namespace begins with."""
        return self.name + "."

    def of(self, name: str | None) -> str | None:
        """`name` in the namespace; unchanged if it already is, empty (the default exchange) or None."""
        if not name or name.startswith(self.prefix):
            return name
        return self.prefix + name

    def exchange(self, exchange: Exchange | None) -> Exchange | None:
        """A copy of `exchange` named in the namespace (the default exchange, '', stays itself)."""
        if exchange is None or not exchange.name or exchange.name.startswith(self.prefix):
            return exchange
        renamed = copy.copy(exchange)
        renamed.name = self.prefix + exchange.name
        return renamed

    def queue(self, queue: Queue) -> Queue:
        """A copy of `queue` in the namespace: its name, exchange, routing key and bindings."""
        if queue.name.startswith(self.prefix):
            return queue
        renamed = copy.copy(queue)
        renamed.name = self.prefix + queue.name
        # None (no exchange given) stays None: Celery gives such a queue the default exchange, in the namespace.
        renamed.exchange = self.exchange(queue.exchange)  # type: ignore[assignment]
        renamed.routing_key = self.of(queue.routing_key)  # type: ignore[assignment]
        renamed.bindings = {
            binding(self.exchange(b.exchange), self.of(b.routing_key), b.arguments, b.unbind_arguments)
            for b in queue.bindings
        }
        return renamed

    def route(self, route: Any) -> Any:
        """A destination (a queue name, or a route/options dict) with its queue, exchange and routing key in the
        namespace."""
        if isinstance(route, str):
            return self.of(route)
        if not isinstance(route, dict):
            return route
        named = dict(route)
        queue = named.get("queue")
        if isinstance(queue, Queue):
            named["queue"] = self.queue(queue)
        elif isinstance(queue, str):
            named["queue"] = self.of(queue)
        exchange = named.get("exchange")
        if isinstance(exchange, Exchange):
            named["exchange"] = self.exchange(exchange)
        elif isinstance(exchange, str):
            named["exchange"] = self.of(exchange)
        if isinstance(named.get("routing_key"), str):
            named["routing_key"] = self.of(named["routing_key"])
        return named


class _NamespacedRouter(Router):  # type: ignore[misc]
    """Celery's router, every destination it expands (routes, task options, call options) in the namespace."""

    def __init__(self, namespace: Namespace, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.namespace = namespace

    def expand_destination(self, route: Any) -> Any:
        """Celery's expansion of `route`, its names first put in the namespace (already there: unchanged)."""
        return super().expand_destination(self.namespace.route(route))


@dataclass
class Isolation:
    """An app isolated on a test database: the test's namespace, and the app's settings to put back."""

    app: Any
    url: str
    namespace: Namespace
    saved: dict[str, tuple[bool, Any]] = field(default_factory=dict)
    entered: int = 0


def isolate(app: Any, url: str) -> Isolation:
    """Set the app on the test database `url`, its queues and routes in the test's namespace and its results under
    it; return what to put back. For a kit worker subprocess (for good); a test process uses `isolated`."""
    conf = app.conf
    namespace = Namespace(namespace_of(url))
    settings: dict[str, Any] = {CONF_DATABASE_URL: url, **_routing(conf, namespace), **_results(app, url, namespace)}
    saved = {key: (key in conf.changes, conf.changes.get(key)) for key in (CONF_DATABASE_URL, *_ROUTING, *_RESULTS)}
    for key, value in settings.items():
        conf[key] = value  # the app's configuration is loaded first: these win over it
    _recompute(app, namespace)
    return Isolation(app, url, namespace, saved)


_lock = threading.Lock()
_active: dict[int, Isolation] = {}  # id(app) -> its isolation in this process


@contextmanager
def isolated(app: Any, url: str) -> Iterator[Isolation]:
    """Isolate `app` on the test database `url` for the block (see the module), then put its settings back.

    Entered again for the same app and database, the block shares the isolation already in place; for another
    database of the same app: ConfigurationError (one test database per app and test).
    """
    app.finalize()
    with _lock:
        current = _active.get(id(app))
        if current is not None and current.url != url:
            raise ConfigurationError(
                f"the app {app.main} is already isolated on the test database {_hidden(current.url)}; give every "
                f"worker and relay of a test that test's database, not also {_hidden(url)}"
            )
        if current is None:
            current = _active[id(app)] = isolate(app, url)
        current.entered += 1
    env = _set_env(url) if current.entered == 1 else None
    try:
        yield current
    finally:
        with _lock:
            current.entered -= 1
            last = current.entered == 0
            if last:
                del _active[id(app)]
        if last:
            _leave(current)
            if env is not None:
                _put_env(env)


def _routing(conf: Any, namespace: Namespace) -> dict[str, Any]:
    """The routing settings in the namespace: the default queue, and the default exchange, routing key and
    declared queues where the app sets them (unset, Celery derives the first two from the default queue)."""
    settings: dict[str, Any] = {"task_default_queue": namespace.of(str(conf.task_default_queue or "celery"))}
    for key in ("task_default_exchange", "task_default_routing_key"):
        if conf.get(key):
            settings[key] = namespace.of(str(conf.get(key)))
    queues = conf.get("task_queues")
    if queues:
        listed = queues.values() if isinstance(queues, dict) else queues
        settings["task_queues"] = [namespace.queue(q) if isinstance(q, Queue) else q for q in listed]
    return settings


def _results(app: Any, url: str, namespace: Namespace) -> dict[str, Any]:
    """The result backend's settings for the test: its keys under the namespace, or the test database."""

    configured = app.conf.result_backend
    if not configured or not isinstance(configured, str):
        return {}
    try:
        backend, _ = by_url(configured, app.loader)
    except Exception:  # its library is missing: Celery reports that itself at the first result
        return {}
    if isinstance(backend, type) and issubclass(backend, BaseKeyValueStoreBackend):
        options = dict(app.conf.result_backend_transport_options or {})
        own = str(options.get("global_keyprefix") or "")
        if not own.startswith(namespace.prefix):
            options["global_keyprefix"] = namespace.prefix + own
        return {"result_backend_transport_options": options}
    if isinstance(backend, type) and issubclass(backend, DatabaseBackend):
        return {"result_backend": f"db+{url}"}
    return {}


def _recompute(app: Any, namespace: Namespace | None) -> None:
    """Have Celery compute again what it derived from the settings: queues, router, sender, result backend."""
    amqp = app.amqp
    for name in _AMQP_CACHED:
        amqp.__dict__.pop(name, None)
    if namespace is not None:
        create_missing = app.either("task_create_missing_queues", None)
        amqp.router = _NamespacedRouter(namespace, amqp.routes, amqp.queues, create_missing, app=app)
    # The backend is made per thread (or once, where it is thread-safe) from the settings: this thread's is made
    # again; threads started later (workers, relays) make their own. Handles made before keep theirs.
    app._backend_cache = None
    with suppress(AttributeError):
        del app._local.backend


def _leave(isolation: Isolation) -> None:
    """Delete the test's queues from Redis (best effort), then put the app's settings back."""
    app = isolation.app
    _drop_queues(app, isolation.namespace)
    conf = app.conf
    for key, (was_set, value) in isolation.saved.items():
        if was_set:
            conf[key] = value
        else:
            conf.changes.pop(key, None)
    _recompute(app, None)


def _drop_queues(app: Any, namespace: Namespace) -> None:

    try:
        if on_redis(app):
            drop_queues(app, namespace.prefix)  # the test's keys only, each named: nothing of the developer's goes
    except Exception as exc:  # Redis stopped by the test, say: the keys stay behind, the test's result stands
        logger.warning("could not delete the test's queues of %s: %s", app.main, exc)


def _set_env(url: str) -> dict[str, str | None]:
    """$ONCELERY_DATABASE_URL = url (and no _FILE variant) for the block; return what to put back."""
    names = (ENV_DATABASE_URL, ENV_DATABASE_URL + FILE_SUFFIX)
    before = {name: os.environ.get(name) for name in names}
    os.environ[ENV_DATABASE_URL] = url
    os.environ.pop(ENV_DATABASE_URL + FILE_SUFFIX, None)
    return before


def _put_env(before: dict[str, str | None]) -> None:
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _hidden(url: str) -> str:

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy parses: shown as given, it holds no password we could hide
        return url
